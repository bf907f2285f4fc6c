//! A data loader that caps an epoch's batches and can start from a later epoch's shuffle.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::DatasetError;
use burn::prelude::*;

/// Wraps a loader so that (1) an epoch ends after `max_items` items and (2) a resumed run sees
/// the same shuffles as an uninterrupted one: Burn's loader draws one permutation per epoch from
/// an RNG that checkpoints do not save, so `skip_epochs` permutations are drawn and dropped.
pub struct EpochLoader<O> {
    inner: Arc<dyn DataLoader<O>>,
    max_items: usize,
    skip_epochs: usize,
}

impl<O: Send + 'static> EpochLoader<O> {
    pub fn new(
        inner: Arc<dyn DataLoader<O>>,
        max_items: Option<usize>,
        skip_epochs: usize,
    ) -> Arc<Self> {
        let max_items = max_items.unwrap_or(usize::MAX);
        Arc::new(Self {
            inner,
            max_items,
            skip_epochs,
        })
    }
}

struct CappedIter<'a, O> {
    inner: Box<dyn DataLoaderIterator<O> + 'a>,
    max_items: usize,
}

impl<O> Iterator for CappedIter<'_, O> {
    type Item = Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.inner.progress().items_processed >= self.max_items {
            return None;
        }
        self.inner.next()
    }
}

impl<O> DataLoaderIterator<O> for CappedIter<'_, O> {
    fn progress(&self) -> Progress {
        let progress = self.inner.progress();
        Progress::new(
            progress.items_processed.min(self.max_items),
            self.max_items,
            progress.unit,
        )
    }
}

impl<O: Send + 'static> DataLoader<O> for EpochLoader<O> {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        Box::new(CappedIter {
            inner: self.inner.iter(),
            max_items: self.num_items(),
        })
    }

    fn num_items(&self) -> usize {
        self.inner.num_items().min(self.max_items)
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        let inner = self.inner.to_device(device);
        for _ in 0..self.skip_epochs {
            drop(inner.iter());
        }
        Arc::new(Self {
            inner,
            max_items: self.max_items,
            skip_epochs: 0,
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        Arc::new(Self {
            inner: self.inner.slice(start, end),
            max_items: self.max_items,
            skip_epochs: self.skip_epochs,
        })
    }
}
