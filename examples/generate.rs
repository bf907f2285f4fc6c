//! Continue a prompt with a model `train` wrote, or a Hugging Face Llama checkpoint, through
//! the model's generation cache.
//!
//! ```text
//! cargo run --release --example generate -- --from artifacts/train --prompt "ROMEO:"
//! cargo run --release --example generate -- --temperature 0 --max-tokens 100   # greedy
//! cargo run --release --example generate -- --temperature 0.8 --top-k 40 --top-p 0.95 --seed 7
//! cargo run --release --example generate -- --recompute   # no cache: the baseline
//! ```
//!
//! The continuation streams to stdout as it comes (the prompt is not repeated); a JSON line on
//! stderr says how long the prompt took, how many tokens per second followed, and the bytes
//! held at the peak above the model (its cache and each call's work).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use burn::prelude::*;
use burn_memwall::DeviceChoice;
use burn_memwall::memory::{CountingAllocator, MemoryMeter};
use burn_memwall_models::Error;
use burn_memwall_models::data::TextTokenizer;
use burn_memwall_models::generation::{Sampler, Sampling};
use burn_memwall_models::pretrained::Pretrained;
use clap::Parser;
use serde::Serialize;

#[path = "cli/pipe.rs"]
mod pipe;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser, Debug)]
#[command(about = "Continue a prompt with a model trained by the train example")]
struct Args {
    /// The folder `train` wrote (`--artifacts` there), or a Hugging Face Llama folder
    /// (`config.json`, `model.safetensors` or its shards, `tokenizer.json`).
    #[arg(long, default_value = "artifacts/train")]
    from: PathBuf,
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Tokens to generate; with the prompt, at most the model's context.
    #[arg(long, default_value_t = 200)]
    max_tokens: usize,
    /// Divides the logits before the softmax; 0 takes the likeliest token (greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Draw only among the k likeliest tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Draw only among the likeliest tokens whose probabilities first reach p.
    #[arg(long)]
    top_p: Option<f64>,
    /// Seeds the draws: the same seed, model and prompt give the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute each token from the whole sequence, without the cache: the baseline the cache
    /// is measured against (the same tokens, more slowly).
    #[arg(long)]
    recompute: bool,
    /// auto, flex, wgpu, vulkan, metal, webgpu, cuda, rocm or cpu.
    #[arg(long, default_value = "auto", env = "BURN_DEVICE")]
    device: String,
}

/// What `generate` prints to stderr.
#[derive(Serialize, Debug)]
struct GenerationReport {
    device: String,
    prompt_tokens: usize,
    new_tokens: usize,
    /// The first call: the whole prompt through the model, and the first token chosen.
    prompt_seconds: f64,
    /// Tokens per second after the first, one call each.
    tokens_per_second: f64,
    /// Bytes held at the peak above the model: the cache and each call's work.
    peak_bytes: u64,
}

fn main() {
    pipe::end_quietly_when_the_reader_leaves();
    if let Err(error) = run(Args::parse()) {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let device = DeviceChoice::from_arg_or_env(Some(&args.device))?.device()?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    let mut sampler = Sampler::new(sampling, args.seed)?;
    let (model, tokenizer) = Pretrained::open(&args.from)?.model(&device)?;
    let prompt: Vec<i64> = tokenizer
        .encode(&args.prompt)?
        .into_iter()
        .map(i64::from)
        .collect();
    let context = model.max_seq_len();
    if prompt.is_empty() || args.max_tokens == 0 || prompt.len() + args.max_tokens > context {
        return Err(Error::Generation(format!(
            "a prompt of {} tokens and {} more must fit the model's context of {context} (with \
             a prompt and at least 1 token to generate)",
            prompt.len(),
            args.max_tokens
        ))
        .into());
    }

    let meter = MemoryMeter::new(&device);
    let live = meter.live_bytes();
    meter.reset_peak();
    let mut cache = model.new_generation_cache();
    let mut text = StreamedText::new(&tokenizer);
    let mut sequence = prompt.clone();
    let mut seconds = [0.0; 2];
    for step in 0..args.max_tokens {
        let start = Instant::now();
        // The cache is fed the prompt first, then each token chosen.
        let input = match (args.recompute, step) {
            (false, 0) | (true, _) => &sequence[..],
            (false, _) => &sequence[sequence.len() - 1..],
        };
        let tokens =
            Tensor::<2, Int>::from_data(TensorData::new(input.to_vec(), [1, input.len()]), &device);
        let logits = match args.recompute {
            true => {
                let logits = model.forward(tokens);
                logits.narrow(1, sequence.len() - 1, 1).squeeze_dim(1)
            }
            false => model.next_logits(tokens, &mut cache),
        };
        let token = sampler.next(logits)?[0];
        seconds[usize::from(step > 0)] += start.elapsed().as_secs_f64();
        text.push(token as u32)?;
        sequence.push(token as i64);
    }
    text.finish()?;
    let report = GenerationReport {
        device: burn_memwall::device::describe(&device),
        prompt_tokens: prompt.len(),
        new_tokens: args.max_tokens,
        prompt_seconds: seconds[0],
        tokens_per_second: (args.max_tokens - 1) as f64 / seconds[1],
        peak_bytes: meter.peak_bytes().saturating_sub(live),
    };
    eprintln!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The continuation written to stdout as its tokens come. A token can end inside a character
/// (byte-level tokenizers split UTF-8), so the text is decoded whole each time and only what
/// is complete is written.
struct StreamedText<'a> {
    tokenizer: &'a TextTokenizer,
    ids: Vec<u32>,
    written: usize,
}

impl<'a> StreamedText<'a> {
    fn new(tokenizer: &'a TextTokenizer) -> Self {
        Self {
            tokenizer,
            ids: Vec::new(),
            written: 0,
        }
    }

    fn push(&mut self, id: u32) -> Result<(), Box<dyn std::error::Error>> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids)?;
        // A character still incomplete decodes as U+FFFD: wait for its next bytes.
        let complete = text.trim_end_matches('\u{FFFD}');
        if complete.len() > self.written && complete.is_char_boundary(self.written) {
            let mut stdout = std::io::stdout().lock();
            stdout.write_all(&complete.as_bytes()[self.written..])?;
            stdout.flush()?;
            self.written = complete.len();
        }
        Ok(())
    }

    /// Writes what is left (an incomplete character as U+FFFD) and ends the line.
    fn finish(self) -> Result<(), Box<dyn std::error::Error>> {
        let text = self.tokenizer.decode(&self.ids)?;
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(text.as_bytes().get(self.written..).unwrap_or_default())?;
        writeln!(stdout)?;
        Ok(())
    }
}
