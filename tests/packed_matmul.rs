//! The products with a packed weight against an f64 host reference built from the ternaries the
//! codes were packed from (not from the library's decoders), for both packings, both products,
//! shapes that are not whole tiles or groups and shapes of several tiles and blocks. The memory
//! claim is `packed_matmul_memory.rs`'s.

mod common;

use burn::prelude::*;
use burn::tensor::DType;
use burn_memwall::codes::PackedLayout;
use burn_memwall::nn::PackedWeight;
use burn_memwall::ops::packed_matmul::BLOCK_WEIGHTS;
use common::packed_weight::{HostWeight, layouts};
use common::{assert_close, devices, host_tensor, rows_of};

fn product(a: &[Vec<f64>], b: &[Vec<f64>]) -> TensorData {
    let rows: Vec<Vec<f64>> = a
        .iter()
        .map(|a| {
            (0..b[0].len())
                .map(|j| a.iter().zip(b).map(|(x, row)| x * row[j]).sum())
                .collect()
        })
        .collect();
    common::flat(&rows)
}

fn transpose(a: &[Vec<f64>]) -> Vec<Vec<f64>> {
    (0..a[0].len())
        .map(|j| a.iter().map(|row| row[j]).collect())
        .collect()
}

#[test]
fn both_products_match_a_host_reference() {
    // (m, d_input, d_output): one weight; partial groups and tiles; 2 and 4 rows per unit of
    // the kernel; several tiles on every side; several Flex blocks.
    let shapes = [
        (1, 1, 1),
        (6, 37, 23),
        (20, 50, 300),
        (40, 33, 17),
        (150, 100, 270),
        (3, 600, 500),
    ];
    const { assert!(600 * 500 > BLOCK_WEIGHTS) };
    for device in devices() {
        for (m, d_input, d_output) in shapes {
            let host = HostWeight::new(d_input, d_output, (m * d_input + d_output) as u64);
            let dense = host.dense();
            let x = host_tensor([m, d_input], 0.3, &device);
            let dy = host_tensor([m, d_output], 1.1, &device);
            let want_y = product(&rows_of(x.clone()), &transpose(&dense));
            let want_dx = product(&rows_of(dy.clone()), &dense);
            for layout in layouts() {
                let case = (m, d_input, d_output, layout, &device);
                let weight = host.on(layout, &device);
                let y = weight.matmul(x.clone());
                assert_eq!(y.dims(), [m, d_output]);
                assert_close("x·Wᵀ", &case, 1e-5, y.into_data(), want_y.clone());
                let dx = weight.matmul_transposed(dy.clone());
                assert_eq!(dx.dims(), [m, d_input]);
                assert_close("dy·W", &case, 1e-5, dx.into_data(), want_dx.clone());
                let empty = weight.matmul(Tensor::zeros([0, d_input], &device));
                assert_eq!(empty.dims(), [0, d_output], "{case:?}");
                assert_eq!(empty.into_data().num_elements(), 0, "{case:?}");
            }
        }
    }
}

#[test]
fn forward_keeps_the_leading_dimensions_and_the_dtype() {
    let device = Device::flex();
    let host = HostWeight::new(20, 9, 3);
    let weight = host.on(PackedLayout::Ternary, &device);
    let x = host_tensor([2, 3, 20], 0.5, &device);
    let y = weight.forward(x.clone().cast(DType::F16));
    assert_eq!((y.dims(), y.dtype()), ([2, 3, 9], DType::F16));
    let want = weight.matmul(x.reshape([6, 20])).into_data();
    assert_close("f16", &"", 2e-3, y.reshape([6, 9]).into_data(), want);
}

#[test]
#[should_panic(expected = "the input's width must be the weight's d_output")]
fn refuses_a_gradient_of_the_wrong_width() {
    let device = Device::flex();
    let weight = HostWeight::new(20, 9, 3).on(PackedLayout::Ternary, &device);
    weight.matmul_transposed(host_tensor([2, 20], 0.5, &device));
}

#[test]
#[should_panic(expected = "the codes must be u32 words")]
fn refuses_codes_of_the_wrong_shape() {
    let device = Device::flex();
    let mut weight = HostWeight::new(20, 9, 3).on(PackedLayout::Ternary, &device);
    weight.d_input = 40; // three words per row, where the codes have two
    weight.matmul(host_tensor([2, 40], 0.5, &device));
}

#[test]
fn rows_decode_exactly_the_rows_asked_for() {
    // 37 inputs: a partial group of 16; ids repeated, out of order, first and last.
    let ids = [4i64, 0, 22, 4, 13, 22];
    for device in devices() {
        for layout in layouts() {
            let host = HostWeight::new(37, 23, 5);
            let dense = host.dense();
            let weight = host.on(layout, &device);
            let got = weight.rows(Tensor::<1, Int>::from_data(ids, &device));
            let want: Vec<Vec<f64>> = ids.iter().map(|&id| dense[id as usize].clone()).collect();
            // s·t of an f32 scale: exact.
            assert_close(
                "rows",
                &(layout, &device),
                0.0,
                got.into_data(),
                common::flat(&want),
            );
        }
    }
}

#[test]
fn a_weight_narrowed_to_some_rows_multiplies_with_those_rows() {
    // A view that starts inside its buffer: Flex reads `storage()` from the buffer's start.
    let host = HostWeight::new(37, 23, 9);
    let dense = host.dense();
    for device in devices() {
        for layout in layouts() {
            let weight = host.on(layout, &device);
            let rows = PackedWeight {
                codes: weight.codes.clone().narrow(0, 5, 11),
                scale: weight.scale.clone().narrow(0, 5, 11),
                ..weight
            };
            let x = host_tensor([3, 37], 0.2, &device);
            let got = rows.matmul(x.clone());
            let want = product(&rows_of(x), &transpose(&dense[5..16]));
            assert_close("narrowed", &(layout, &device), 1e-5, got.into_data(), want);
        }
    }
}
