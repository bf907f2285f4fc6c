//! Text items, a byte tokenizer with a padding token, and the batcher of Burn's example: pad to
//! the longest item, inputs and targets shifted by one, the padding mask beside them.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::attention::generate_padding_mask;
use burn::prelude::*;

/// One piece of text to learn from.
#[derive(Clone, Debug)]
pub struct TextGenerationItem {
    /// The text.
    pub text: String,
}

/// One id per byte, and one more for padding: any UTF-8 text, no vocabulary to train or
/// download (Burn's example downloads GPT-2's).
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Bytes take ids `0..256`.
    pub const PAD_TOKEN: usize = 256;

    /// The ids of `text`'s bytes.
    pub fn encode(&self, text: &str) -> Vec<usize> {
        text.bytes().map(usize::from).collect()
    }

    /// The embedding size a model needs: the bytes and the padding token.
    pub fn vocab_size(&self) -> usize {
        Self::PAD_TOKEN + 1
    }
}

/// `text` cut into consecutive items of `max_chars`, ⅞, ¾ and ⅝ of it in turn, so that a batch
/// pads its shorter items; the last, shorter piece is kept if it has a target.
///
/// # Panics
/// If `max_chars` is 0.
pub fn text_items(text: &str, max_chars: usize) -> InMemDataset<TextGenerationItem> {
    assert!(max_chars > 0, "an item needs at least one character");
    let chars: Vec<char> = text.chars().collect();
    let mut items = Vec::new();
    let mut start = 0;
    while chars.len() - start >= 2 {
        let len = (max_chars - max_chars * (items.len() % 4) / 8).max(2);
        let end = (start + len).min(chars.len());
        items.push(TextGenerationItem {
            text: chars[start..end].iter().collect(),
        });
        start = end;
    }
    InMemDataset::new(items)
}

/// A batch for training: next-token targets and the inputs' padding.
#[derive(Clone, Debug)]
pub struct TrainingTextGenerationBatch {
    /// `[batch, seq]` token ids.
    pub tokens_inputs: Tensor<2, Int>,
    /// `[batch, seq]`: each input's next token, the padding token past an item's end.
    pub targets: Tensor<2, Int>,
    /// `[batch, seq]`, true at padding.
    pub mask_pad: Tensor<2, Bool>,
}

/// Tokenizes items and pads them to the longest, at most `max_seq_length + 1` tokens (one
/// more than the model sees, for the last target).
#[derive(Clone, Debug)]
pub struct TextGenerationBatcher {
    tokenizer: ByteTokenizer,
    max_seq_length: usize,
}

impl TextGenerationBatcher {
    /// Batches of at most `max_seq_length` input tokens.
    pub fn new(tokenizer: ByteTokenizer, max_seq_length: usize) -> Self {
        Self {
            tokenizer,
            max_seq_length,
        }
    }
}

impl Batcher<TextGenerationItem, TrainingTextGenerationBatch> for TextGenerationBatcher {
    fn batch(
        &self,
        items: Vec<TextGenerationItem>,
        device: &Device,
    ) -> TrainingTextGenerationBatch {
        let tokens = items
            .iter()
            .map(|item| self.tokenizer.encode(&item.text))
            .collect();
        let padded = generate_padding_mask(
            ByteTokenizer::PAD_TOKEN,
            tokens,
            Some(self.max_seq_length + 1),
            device,
        );
        let [batch, length] = padded.tensor.dims();
        TrainingTextGenerationBatch {
            tokens_inputs: padded.tensor.clone().slice([0..batch, 0..length - 1]),
            targets: padded.tensor.slice([0..batch, 1..length]),
            mask_pad: padded.mask.slice([0..batch, 0..length - 1]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::Dataset;

    #[test]
    fn items_cover_the_text_in_order_with_varying_lengths() {
        let text = "abcdefghijklmnopqrstuvwxyz0123456789";
        let items = text_items(text, 8);
        let texts: Vec<String> = items.iter().map(|item| item.unwrap().text).collect();
        assert_eq!(texts.concat(), text, "no character lost or repeated");
        let lengths: Vec<usize> = texts.iter().map(String::len).collect();
        assert_eq!(lengths, [8, 7, 6, 5, 8, 2]);
    }

    #[test]
    fn targets_are_the_next_inputs_and_padding_is_masked() {
        let device = Device::flex();
        let batcher = TextGenerationBatcher::new(ByteTokenizer, 4);
        let item = |text: &str| TextGenerationItem { text: text.into() };
        let batch = batcher.batch(vec![item("abcdefg"), item("xyz")], &device);
        let ids = |t: Tensor<2, Int>| t.into_data().iter::<i64>().collect::<Vec<_>>();
        let pad = ByteTokenizer::PAD_TOKEN as i64;
        let (a, x) = (b'a' as i64, b'x' as i64);
        // "abcdefg" is cut to 5 tokens (4 inputs and the last target); "xyz" is padded.
        assert_eq!(
            ids(batch.tokens_inputs),
            [a, a + 1, a + 2, a + 3, x, x + 1, x + 2, pad]
        );
        assert_eq!(
            ids(batch.targets),
            [a + 1, a + 2, a + 3, a + 4, x + 1, x + 2, pad, pad]
        );
        let mask: Vec<bool> = batch.mask_pad.into_data().iter::<bool>().collect();
        assert_eq!(
            mask,
            [false, false, false, false, false, false, false, true]
        );
    }
}
