//! Tokenizers, text loading, token windows and batches.

mod common;

use std::sync::Arc;

use burn::data::dataset::Dataset;
use burn::prelude::*;
use burn_memwall_models::Error;
use burn_memwall_models::data::{
    Corpus, DEFAULT_CORPUS, END_OF_TEXT, LmBatcher, TextTokenizer, TokenWindows, load_text,
    split_text,
};

const SAMPLE: &str = "Fables: the fox, the crow — and the 🦊!\n\tΑλώπηξ καὶ βότρυς.\r\n";

#[test]
fn byte_level_tokenizer_is_exact_and_has_256_ids() {
    let tokenizer = TextTokenizer::byte_level();
    assert_eq!(tokenizer.vocab_size(), 256);
    let ids = tokenizer.encode(SAMPLE).unwrap();
    assert_eq!(ids.len(), SAMPLE.len(), "one id per byte");
    assert!(ids.iter().all(|&id| id < 256));
    assert_eq!(tokenizer.decode(&ids).unwrap(), SAMPLE);
    // Distinct bytes map to distinct ids.
    let distinct_bytes: std::collections::HashSet<u8> = SAMPLE.bytes().collect();
    let distinct_ids: std::collections::HashSet<u32> = ids.iter().copied().collect();
    assert_eq!(distinct_bytes.len(), distinct_ids.len());
}

#[test]
fn bpe_learns_merges_round_trips_and_counts_added_tokens() {
    let text = common::tinyshakespeare().unwrap_or_else(|| DEFAULT_CORPUS.repeat(4));
    let text = &text[..text.len().min(300_000)];
    let tokenizer = TextTokenizer::train_bpe(text, 600).unwrap();
    assert_eq!(
        tokenizer.vocab_size(),
        600,
        "256 bytes + merges + {END_OF_TEXT}"
    );
    let eot = tokenizer.encode(END_OF_TEXT).unwrap();
    assert_eq!(eot.len(), 1, "the added token is one id");
    assert!((eot[0] as usize) < tokenizer.vocab_size());

    let ids = tokenizer.encode(text).unwrap();
    assert!(
        ids.len() * 2 < text.len(),
        "merges compress: {} ids for {} bytes",
        ids.len(),
        text.len()
    );
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    assert_eq!(
        tokenizer
            .decode(&tokenizer.encode(SAMPLE).unwrap())
            .unwrap(),
        SAMPLE
    );
}

#[test]
fn tokenizer_json_round_trips_and_loads_as_hugging_face_file() {
    let dir = common::temp_dir();
    let path = dir.path().join("tokenizer.json");
    let trained = TextTokenizer::train_bpe(&DEFAULT_CORPUS.repeat(2), 400).unwrap();
    trained.save(&path).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        json["model"]["type"], "BPE",
        "a standard Hugging Face tokenizer.json"
    );

    let loaded = TextTokenizer::from_file(&path).unwrap();
    assert_eq!(loaded.vocab_size(), trained.vocab_size());
    assert_eq!(
        loaded.encode(DEFAULT_CORPUS).unwrap(),
        trained.encode(DEFAULT_CORPUS).unwrap()
    );
}

#[test]
fn bad_tokenizer_inputs_are_clear_errors() {
    let missing = TextTokenizer::from_file("/no/such/tokenizer.json").unwrap_err();
    assert!(matches!(missing, Error::Io { .. }), "{missing}");
    assert!(missing.to_string().contains("/no/such/tokenizer.json"));

    let dir = common::temp_dir();
    let garbage = dir.path().join("tokenizer.json");
    std::fs::write(&garbage, "{ not json").unwrap();
    assert!(matches!(
        TextTokenizer::from_file(&garbage).unwrap_err(),
        Error::Tokenizer(_)
    ));

    assert!(matches!(
        TextTokenizer::train_bpe("some text", 100).unwrap_err(),
        Error::Tokenizer(_)
    ));
    assert!(matches!(
        TextTokenizer::train_bpe("  \n ", 1000).unwrap_err(),
        Error::Data(_)
    ));
}

#[test]
fn text_loading_rejects_missing_empty_and_binary_files() {
    assert_eq!(load_text(None).unwrap(), DEFAULT_CORPUS);
    assert!(DEFAULT_CORPUS.len() > 10_000);

    let dir = common::temp_dir();
    let missing = load_text(Some(&dir.path().join("missing.txt"))).unwrap_err();
    assert!(
        matches!(missing, Error::Io { .. }) && missing.to_string().contains("missing.txt"),
        "{missing}"
    );

    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, " \n\n").unwrap();
    let error = load_text(Some(&empty)).unwrap_err();
    assert!(
        matches!(error, Error::Data(_)) && error.to_string().contains("empty"),
        "{error}"
    );

    let binary = dir.path().join("binary.bin");
    std::fs::write(&binary, [0x66, 0x6f, 0xff, 0xfe]).unwrap();
    let error = load_text(Some(&binary)).unwrap_err();
    assert!(error.to_string().contains("not UTF-8"), "{error}");
}

#[test]
fn windows_shift_targets_by_one_and_split_without_overlap() {
    let tokens: Vec<u32> = (0..103).collect();
    let train = TokenWindows::new(tokens[..82].into(), 10, 200).unwrap();
    let valid = TokenWindows::new(tokens[82..].into(), 10, 200).unwrap();
    assert_eq!(
        train.len(),
        8,
        "(82 - 1) / 10 windows of 11 in the first 82 tokens"
    );
    assert_eq!(valid.len(), 2);
    assert_eq!(train.get(1).unwrap(), (10..21).collect::<Vec<_>>());
    assert_eq!(valid.get(0).unwrap(), (82..93).collect::<Vec<_>>());
    assert!(
        train.get(8).is_err(),
        "past the end is an error, not a panic"
    );

    let device = Device::flex();
    let batch = LmBatcher::batch_windows(&[train.get(0).unwrap(), train.get(3).unwrap()], &device);
    assert_eq!(batch.inputs.dims(), [2, 10]);
    let inputs = batch.inputs.into_data().try_into_vec_as::<i64>().unwrap();
    let targets = batch.targets.into_data().try_into_vec_as::<i64>().unwrap();
    assert_eq!(&inputs[..3], &[0, 1, 2]);
    assert_eq!(&targets[..3], &[1, 2, 3]);
    assert_eq!(&inputs[10..13], &[30, 31, 32]);
    assert_eq!(targets[19], 40);
}

#[test]
fn bad_token_data_is_a_clear_error() {
    let tokens: Arc<[u32]> = vec![1, 2, 300, 4, 5].into();
    let error = TokenWindows::new(tokens, 2, 256).unwrap_err();
    assert!(
        matches!(
            error,
            Error::TokenOutOfRange {
                id: 300,
                position: 2,
                vocab_size: 256
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("300") && error.to_string().contains("256"));

    let short: Arc<[u32]> = vec![1, 2, 3].into();
    assert!(matches!(
        TokenWindows::new(short, 8, 256).unwrap_err(),
        Error::Data(_)
    ));
    for fraction in [0.0, 1.0, 1.5, f64::NAN] {
        let error = split_text(SAMPLE, fraction).unwrap_err();
        assert!(error.to_string().contains("validation fraction"), "{error}");
    }
}

/// The text is cut at the first whitespace from the fraction's share of its bytes, and each side is
/// tokenized alone: a BPE trained on the training side has never seen the validation text.
#[test]
fn a_corpus_splits_its_text_and_tokenizes_each_side() {
    let (train, valid) = split_text(SAMPLE, 0.4).unwrap();
    assert_eq!(format!("{train}{valid}"), SAMPLE);
    let cut = (SAMPLE.len() as f64 * 0.6) as usize;
    assert!(train.len() >= cut, "{} vs {cut}", train.len());
    assert!(
        valid.starts_with(char::is_whitespace)
            && !SAMPLE.as_bytes()[cut..train.len()]
                .iter()
                .any(u8::is_ascii_whitespace),
        "cut at the first whitespace from byte {cut}: {train:?} | {valid:?}"
    );
    let corpus = Corpus::new(TextTokenizer::byte_level(), SAMPLE, 0.4).unwrap();
    assert_eq!(
        corpus.train(),
        TextTokenizer::byte_level().encode(train).unwrap()
    );
    assert_eq!(
        corpus.valid(),
        TextTokenizer::byte_level().encode(valid).unwrap()
    );
    assert_eq!(corpus.unknown_share(), 0.0);

    // Content, not names: the same text gives the same identity, one changed byte another.
    let identity = corpus.identity().unwrap();
    assert_eq!(
        identity,
        Corpus::new(TextTokenizer::byte_level(), SAMPLE, 0.4)
            .unwrap()
            .identity()
            .unwrap()
    );
    let edited = SAMPLE.replacen("fox", "fix", 1);
    let other = Corpus::new(TextTokenizer::byte_level(), &edited, 0.4)
        .unwrap()
        .identity()
        .unwrap();
    assert_ne!(identity.tokens_sha256, other.tokens_sha256);
    assert_eq!(identity.tokenizer_sha256, other.tokenizer_sha256);
    // A tokenizer saved and read back is the same tokenizer.
    let dir = common::temp_dir();
    let path = dir.path().join("tokenizer.json");
    let bpe = TextTokenizer::train_bpe(DEFAULT_CORPUS, 300).unwrap();
    bpe.save(&path).unwrap();
    let saved = Corpus::new(bpe, SAMPLE, 0.4).unwrap().identity().unwrap();
    let loaded = Corpus::new(TextTokenizer::from_file(&path).unwrap(), SAMPLE, 0.4)
        .unwrap()
        .identity()
        .unwrap();
    assert_eq!(saved, loaded);
    assert_ne!(saved.tokenizer_sha256, identity.tokenizer_sha256);
}

/// A `tokenizer.json` written by another library (here a WordLevel model with two added
/// tokens, one of them outside the model's vocabulary) loads, and its vocabulary size counts
/// the added tokens, since the embedding must cover every id the tokenizer can emit.
#[test]
fn a_foreign_hugging_face_tokenizer_loads_with_its_added_tokens() {
    let json = r#"{
      "version": "1.0",
      "truncation": null,
      "padding": null,
      "added_tokens": [
        {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 5, "content": "<pad>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": null,
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "fox": 2, "and": 3, "grapes": 4}, "unk_token": "[UNK]"}
    }"#;
    let dir = common::temp_dir();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    let tokenizer = TextTokenizer::from_file(&path).unwrap();
    assert_eq!(tokenizer.vocab_size(), 6, "5 model ids + the added <pad>");
    assert_eq!(
        tokenizer.encode("the fox and the crow").unwrap(),
        vec![1, 2, 3, 1, 0]
    );
    assert_eq!(tokenizer.encode("<pad>").unwrap(), vec![5]);

    // Text the vocabulary does not cover becomes [UNK]: counted, and refused when most is.
    let corpus = Corpus::new(
        tokenizer.clone(),
        "the fox and the grapes and the crow",
        0.3,
    )
    .unwrap();
    assert!(
        (corpus.unknown_share() - 1.0 / 8.0).abs() < 1e-12,
        "{}",
        corpus.unknown_share()
    );
    let error = Corpus::new(tokenizer, "a crow, a lion and a mouse", 0.3).unwrap_err();
    assert!(error.to_string().contains("unknown token"), "{error}");
}

/// A tokenizer of one id gives a model nothing to predict: refused, as is a model config with
/// a vocabulary of 1.
#[test]
fn a_vocabulary_of_one_is_refused() {
    let json = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
      "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}
    }"#;
    let dir = common::temp_dir();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    let tokenizer = TextTokenizer::from_file(&path).unwrap();
    let error = Corpus::new(tokenizer, SAMPLE, 0.1).unwrap_err();
    assert!(error.to_string().contains("vocabulary of 1"), "{error}");
    let mut config = burn_memwall_models::lm::LmConfig::preset("tiny").unwrap();
    config.vocab_size = 1;
    let error = config.validate().unwrap_err();
    assert!(error.to_string().contains("vocabulary of 1"), "{error}");
}
