//! The Flex path: a block of rows decoded on the host, then Flex's matmul.

use std::ops::Range;

use burn::backend::Flex;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::prelude::*;
use burn::tensor::DType;
use rayon::prelude::*;

use super::{PackedMatmulBackend, PackedShape, Product, row_blocks};
use crate::ops::flex::{contiguous_f32, contiguous_u32, float, primitive};

/// Rows `rows` of the weight packed in `words` and `scale`, decoded: `[rows.len(), d_input]`.
fn decode(words: &[u32], scale: &[f32], weight: PackedShape, rows: Range<usize>) -> Tensor<2> {
    let (layout, d_input) = (weight.layout, weight.d_input);
    let width = layout.words_per_row(d_input);
    let mut dense = vec![0f32; rows.len() * d_input];
    dense
        .par_chunks_mut(d_input.max(1))
        .zip(rows.clone())
        .for_each(|(out, row)| {
            layout.decode_row(&words[row * width..(row + 1) * width], scale[row], out)
        });
    Tensor::<2>::from_data(
        TensorData::new(dense, [rows.len(), d_input]),
        (&Device::flex(), DType::F32),
    )
}

impl PackedMatmulBackend for Flex {
    fn packed_decode(
        codes: IntTensor<Flex>,
        scale: FloatTensor<Flex>,
        weight: PackedShape,
    ) -> FloatTensor<Flex> {
        let (codes, scale) = (contiguous_u32(codes), contiguous_f32(scale));
        let (words, scale) = (codes.storage::<u32>(), scale.storage::<f32>());
        primitive(decode(words, scale, weight, 0..weight.d_output), DType::F32)
    }

    fn packed_matmul(
        input: FloatTensor<Flex>,
        codes: IntTensor<Flex>,
        scale: FloatTensor<Flex>,
        weight: PackedShape,
        product: Product,
    ) -> FloatTensor<Flex> {
        let input: Tensor<2> = float(input);
        let (codes, scale) = (contiguous_u32(codes), contiguous_f32(scale));
        let (words, scale) = (codes.storage::<u32>(), scale.storage::<f32>());
        let decode = |rows| decode(words, scale, weight, rows);
        let blocks = row_blocks(weight.d_input, weight.d_output);
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
}
