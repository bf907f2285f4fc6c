//! The Flex path: a block of rows decoded on the host, then Flex's matmul.

use burn::backend::Flex;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::prelude::*;
use burn::tensor::DType;
use rayon::prelude::*;

use super::{PackedShape, Product, row_blocks};
use crate::ops::flex::{contiguous_f32, contiguous_u32, float, primitive};

pub(super) fn packed_matmul(
    input: FloatTensor<Flex>,
    codes: IntTensor<Flex>,
    scale: FloatTensor<Flex>,
    weight: PackedShape,
    product: Product,
) -> FloatTensor<Flex> {
    let input: Tensor<2> = float(input);
    let device = input.device();
    let (codes, scale) = (contiguous_u32(codes), contiguous_f32(scale));
    let (words, scale) = (codes.storage::<u32>(), scale.storage::<f32>());
    let PackedShape {
        layout,
        d_input,
        d_output,
    } = weight;
    let width = layout.words_per_row(d_input);
    let decode = |rows: std::ops::Range<usize>| {
        let mut dense = vec![0f32; rows.len() * d_input];
        dense
            .par_chunks_mut(d_input)
            .zip(rows.clone())
            .for_each(|(out, row)| {
                layout.decode_row(&words[row * width..(row + 1) * width], scale[row], out)
            });
        Tensor::<2>::from_data(
            TensorData::new(dense, [rows.len(), d_input]),
            (&device, DType::F32),
        )
    };
    let blocks = row_blocks(d_input, d_output);
    let output = match product {
        Product::Forward => Tensor::cat(
            blocks
                .map(|rows| input.clone().matmul(decode(rows).transpose()))
                .collect(),
            1,
        ),
        Product::Transposed => blocks
            .map(|rows| {
                let (start, len) = (rows.start, rows.len());
                input.clone().narrow(1, start, len).matmul(decode(rows))
            })
            .reduce(|sum, part| sum + part)
            .expect("a weight has at least one row"),
    };
    primitive(output, DType::F32)
}
