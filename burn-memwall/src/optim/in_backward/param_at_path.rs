//! One parameter dressed as a module whose only parameter sits at its path in the full model,
//! so that a `ModuleOptimizer` stepping it matches parameter groups, per-group learning rates
//! and record paths exactly as a step over the whole model would.

use burn::module::{Devices, Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;

#[derive(Clone, Debug)]
pub(super) struct ParamAtPath<const D: usize> {
    /// `(name, container type)` of every module from the model's root down to the parameter,
    /// as the model's own traversal reports them; the last name is the parameter's field name.
    pub path: Vec<(String, String)>,
    pub param: Param<Tensor<D>>,
}

impl<const D: usize> ParamAtPath<D> {
    fn with_param(self, f: impl FnOnce(Param<Tensor<D>>) -> Param<Tensor<D>>) -> Self {
        Self {
            param: f(self.param),
            path: self.path,
        }
    }
}

impl<const D: usize> Module for ParamAtPath<D> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.param.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.with_param(|param| param.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.with_param(|param| param.to_device(device))
    }

    fn train(self) -> Self {
        self.with_param(Module::train)
    }

    fn valid(&self) -> Self {
        self.clone().with_param(|param| param.valid())
    }

    fn materialize(self) -> Self {
        self.with_param(Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        for (name, container) in &self.path {
            visitor.enter_module(name, container);
        }
        self.param.visit(visitor);
        for (name, container) in self.path.iter().rev() {
            visitor.exit_module(name, container);
        }
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        for (name, container) in &self.path {
            mapper.enter_module(name, container);
        }
        let param = Module::map(self.param, mapper);
        for (name, container) in self.path.iter().rev() {
            mapper.exit_module(name, container);
        }
        Self {
            path: self.path,
            param,
        }
    }
}
