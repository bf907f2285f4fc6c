"""Tiny Llama-format checkpoints and what transformers computes with them, for
`tests/llama_import.rs`: each folder under tests/fixtures/llama/ holds a `config.json` and a
`model.safetensors` written by `LlamaForCausalLM.save_pretrained`, and `expected.json` with
the logits of a fixed input and the greedy continuation `generate` makes; `gqa-sharded` holds
`gqa`'s weights in shards with their index.

Run from the repository root (needs torch, transformers and safetensors, none of which the
Rust build or its tests need):

    python scripts/llama_fixtures.py
"""

import json
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama"
INPUT_IDS = [3, 17, 42, 5, 61, 8, 29, 11]
NEW_TOKENS = 12


def make(name: str, sharded: bool = False, **overrides) -> None:
    settings = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    config = LlamaConfig(**{**settings, **overrides})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # transformers initialises with std 0.02: logits that small would hide a wrong weight.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5 if parameter.dim() > 1 else 0.2)
            if parameter.dim() == 1:
                parameter.add_(1.0)
    folder = ROOT / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if sharded:
        # The same weights in shards of at most 40 kB, with their index.
        model.save_pretrained(
            ROOT / f"{name}-sharded", safe_serialization=True, max_shard_size="40KB"
        )
        (ROOT / f"{name}-sharded" / "generation_config.json").unlink(missing_ok=True)
    ids = torch.tensor([INPUT_IDS])
    with torch.no_grad():
        logits = model(ids).logits[0]
        generated = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(ids),
            pad_token_id=0,
        )[0, len(INPUT_IDS):]
    expected = {
        "input_ids": INPUT_IDS,
        "logits": [[float(v) for v in row] for row in logits],
        "greedy": [int(t) for t in generated],
    }
    (folder / "expected.json").write_text(json.dumps(expected) + "\n")
    # save_pretrained also writes generation_config.json, which the import does not read.
    (folder / "generation_config.json").unlink(missing_ok=True)


make("gqa", sharded=True)
make("tied", tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500000.0)
