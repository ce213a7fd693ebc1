"""Train pagedserve's shipped default model: a tiny Llama that writes Python.

The corpus is the Python standard library's own source, which every machine has offline. The
script trains a byte-level BPE tokenizer with `tokenizers`, then a small Llama-architecture
causal LM with HF transformers, on the CPU, seeded. It writes the model in plain HF format
(config, safetensors, tokenizer with a chat template, generation config) and its loss curve as
a PNG, and records how it was made in `training.json`.

A second run with `--init-from` and `--unlikelihood-steps` fine-tunes a saved model against
repeating whole lines in its greedy continuations. The shipped model, on one core:

    pip install -e ".[bench]"
    python ops/train_tiny_model.py --threads 1 --steps 2200 --minutes 125 --out /tmp/pretrained   # 84 min
    python ops/train_tiny_model.py --threads 1 --init-from /tmp/pretrained --steps 0 --unlikelihood-steps 250
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def corpus_files() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
    skip = ("/test", "site-packages", "idlelib", "/lib2to3/tests")
    return [f for f in files if not any(s in f for s in skip)]


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="ignore") as f:
        return f.read()


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    # A newline is always a token of its own, so a prompt that ends with one ("def f():\n") is
    # split as the training text was, not cut inside a newline-and-indent token.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split("\n", behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def batches(tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    """Random windows of the token stream, in a seeded order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "tiny-python")
    )
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--minutes", type=float, default=120.0, help="stop early after this long")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's choice")
    parser.add_argument("--files", type=int, default=0, help="use only the first N corpus files (quick checks)")
    parser.add_argument("--no-plot", action="store_true", help="skip the loss curve (needs matplotlib)")
    parser.add_argument("--init-from", default=None, help="start from a model this script saved (its tokenizer too)")
    parser.add_argument(
        "--unlikelihood-steps",
        type=int,
        default=0,
        help="then fine-tune this many steps against repeating its own greedy continuations",
    )
    parser.add_argument("--unlikelihood-lr", type=float, default=3e-4)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    files = corpus_files()[: args.files or None]
    texts = [read(f) for f in files]
    if args.init_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
    else:
        tokenizer = train_tokenizer(texts, args.vocab_size)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(eos)
    tokens = torch.tensor(ids, dtype=torch.long)
    print(f"corpus: {len(files)} files, {len(tokens):,} tokens", flush=True)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    config.architectures = ["LlamaForCausalLM"]
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(config)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 100

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    losses: list[tuple[int, float]] = []
    started = time.monotonic()
    model.train()
    step = 0
    for step, (inputs, targets) in enumerate(batches(tokens, args.seq_len, args.batch_size, args.seed)):
        if step >= args.steps or time.monotonic() - started > args.minutes * 60:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append((step, loss.item()))
        if step % 50 == 0:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.monotonic() - started:6.0f}s", flush=True)

    unlikelihood_losses = (
        fine_tune_against_repetition(model, tokenizer, tokens, args) if args.unlikelihood_steps else []
    )
    last_losses = ([loss for _, loss in losses] + [lm for _, lm, _, _ in unlikelihood_losses])[-50:]
    model.eval()
    os.makedirs(args.out, exist_ok=True)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.to(torch.bfloat16)  # half the file; bf16 to float32 is exact, so nothing changes on loading
    model.config.dtype = torch.bfloat16
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)  # the template inside tokenizer_config.json
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(
            {
                "steps": len(losses),
                "tokens_seen": len(losses) * args.batch_size * args.seq_len,
                "final_loss": sum(last_losses) / max(1, len(last_losses)),
                "seconds": round(time.monotonic() - started),
                "seed": args.seed,
                "corpus_files": len(files),
                "corpus_tokens": len(tokens),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "argv": sys.argv[1:],
                "init_from": started_from(args.init_from),
                "unlikelihood": [
                    {
                        "step": s,
                        "lm_loss": round(lm, 4),
                        "unlikelihood_loss": round(ul, 4),
                        "repeated_token_share": round(share, 4),
                    }
                    for s, lm, ul, share in unlikelihood_losses
                ],
            },
            f,
            indent=2,
        )
    if not args.no_plot:
        if losses:
            plot(losses, os.path.join(args.out, "loss.png"))
        elif args.init_from and os.path.abspath(args.init_from) != os.path.abspath(args.out):
            shutil.copy(os.path.join(args.init_from, "loss.png"), args.out)  # the pretraining curve
        if unlikelihood_losses:
            plot_fine_tuning(unlikelihood_losses, os.path.join(args.out, "unlikelihood.png"))


def started_from(directory: str | None) -> dict | None:
    """The training record of the checkpoint a run started from, so the chain stays reproducible."""
    if not directory:
        return None
    with open(os.path.join(directory, "training.json")) as f:
        return json.load(f)


def repeated_line_positions(sequence: list[int], start: int, pieces: list[str], limit: int = 2) -> list[int]:
    """Positions at or after `start` of the non-blank tokens of every complete line whose text
    already occurred `limit` times before: the third `self.name = name` in a row, not the second
    `else:` of a function. `pieces` is each token id's text."""
    counts: dict[str, int] = {}
    marked: list[int] = []
    line: list[int] = []
    for position, token in enumerate(sequence):
        if pieces[token] != "\n":
            line.append(position)
            continue
        text = "".join(pieces[sequence[i]] for i in line).strip()
        if text:
            if counts.get(text, 0) >= limit:
                marked += [i for i in line if i >= start and pieces[sequence[i]].strip()]
            counts[text] = counts.get(text, 0) + 1
        line = []
    return marked


def fine_tune_against_repetition(model, tokenizer, tokens: torch.Tensor, args) -> list[tuple[int, float, float, float]]:
    """Sequence-level unlikelihood training (Welleck et al., 2019), with lines for n-grams: continue
    random corpus prefixes greedily, and lower the probability of the tokens of every line that
    repeats for the third time or more, while a corpus batch keeps the language-model loss.
    Returns (step, LM loss, unlikelihood loss, share of continuation tokens marked) per step."""
    prefix_len, continuation = 32, 64
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.unlikelihood_lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = batches(tokens, args.seq_len, args.batch_size, args.seed + 1)
    prefixes = batches(tokens, prefix_len, args.batch_size, args.seed + 2)
    history = []
    started = time.monotonic()
    for step in range(args.unlikelihood_steps):
        model.eval()
        prompt, _ = next(prefixes)
        with torch.no_grad():
            generated = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=continuation,
                min_new_tokens=continuation,
                pad_token_id=model.config.pad_token_id,
            )
        model.train()
        rows, columns = [], []
        for row, sequence in enumerate(generated.tolist()):
            for position in repeated_line_positions(sequence, prefix_len, pieces):
                rows.append(row)
                columns.append(position)
        log_probs = torch.log_softmax(model(input_ids=generated[:, :-1]).logits, dim=-1)
        if rows:
            rows_t, columns_t = torch.tensor(rows), torch.tensor(columns)
            picked = log_probs[rows_t, columns_t - 1, generated[rows_t, columns_t]].exp()
            unlikelihood = -torch.log((1 - picked).clamp(min=1e-5)).mean()
        else:
            unlikelihood = log_probs.sum() * 0.0
        inputs, targets = next(corpus)
        logits = model(input_ids=inputs).logits
        lm = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        (lm + unlikelihood).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        share = len(rows) / (generated.shape[0] * continuation)
        history.append((step, lm.item(), unlikelihood.item(), share))
        if step % 10 == 0:
            print(
                f"unlikelihood step {step:4d}  lm {lm.item():.3f}  ul {unlikelihood.item():.3f}  "
                f"repeated {share:.1%}  {time.monotonic() - started:6.0f}s",
                flush=True,
            )
    return history


def plot(losses: list[tuple[int, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in losses]
    values = [v for _, v in losses]
    window = 25
    smooth = [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, values, alpha=0.3, label="loss")
    axes.plot(steps, smooth, label=f"mean of {window}")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats/token)")
    axes.set_title("tiny-python: training loss on the Python standard library")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def plot_fine_tuning(history: list[tuple[int, float, float, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    steps = [h[0] for h in history]
    axes.plot(steps, [h[1] for h in history], label="LM loss (corpus)")
    axes.plot(steps, [h[2] for h in history], label="unlikelihood loss")
    axes.plot(steps, [h[3] for h in history], label="repeated share of greedy tokens")
    axes.set_xlabel("fine-tuning step")
    axes.set_title("tiny-python: unlikelihood fine-tuning against repetition")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
