"""Decode-mode negative log-likelihood: a long text's continuation scored *through the decode path* — a prefill of
the first tokens, then one token per forward with the cache — so sparse selection is what is measured (scoring the
whole text in one forward would attend densely and hide it).

    python eval/nll.py --prefill 7168 --tokens 512 --budget 1024
"""

from __future__ import annotations

import argparse

import torch


def pydoc_token_ids(tokenizer, count: int, offset: int = 0) -> torch.Tensor:
    """`[1, count]` tokens of Python's documentation (`pydoc_data.topics`, ~113K tokens, ships with CPython)."""
    import pydoc_data.topics as topics

    ids = tokenizer("\n\n".join(topics.topics.values()))["input_ids"][offset : offset + count]
    if len(ids) < count:
        raise ValueError(f"pydoc_data.topics has only {len(ids)} tokens from offset {offset}; ask for fewer")
    return torch.tensor([ids])


@torch.no_grad()
def decode_nll(model, input_ids: torch.Tensor, prefill: int, cache) -> torch.Tensor:
    """Per-token NLL `[n]` (nats) of `input_ids[:, prefill:]` (`[1, prefill + n]`), each token predicted by a decode
    step that fed the previous one through `cache`."""
    ids = input_ids.to(model.device)
    prompt = {"input_ids": ids[:, :prefill], "attention_mask": torch.ones_like(ids[:, :prefill])}
    return teacher_forced_nll(model, prompt, ids[:, prefill:], cache)[0][0]


@torch.no_grad()
def teacher_forced_nll(model, prompt: dict, trajectory: torch.Tensor, cache,
                       chunk: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`([B, n] NLL in nats, [B, n] bool: the step's argmax is the trajectory's token)` of `trajectory` (`[B, n]`)
    after `prompt` (`input_ids` and `attention_mask`, `[B, P]`, left-padded), each token predicted by a decode step
    that fed the previous one through `cache`. Positions follow the attention mask, as `generate` sets them, so a
    model's own greedy trajectory is its argmax throughout. `chunk` > 1: the trajectory goes in forwards of that many
    tokens — for a dense cache only (the same attention as one token per forward, in far fewer forwards); an
    OasisCache must be fed one token per forward (its decode path is what is measured)."""
    from oasis_cache.compat import generate_cache_argument

    arg = generate_cache_argument(model)
    mask = prompt["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=prompt["input_ids"], attention_mask=mask, position_ids=positions, use_cache=True,
                   logits_to_keep=1, **{arg: cache}).logits[:, -1]
    position = positions[:, -1:]
    if chunk > 1:
        from oasis_cache import OasisCache

        if isinstance(cache, OasisCache):
            raise ValueError("teacher_forced_nll(chunk > 1) is for a dense cache: an OasisCache decodes one token per "
                             "forward (a chunk would attend densely)")
        return _chunked(model, arg, cache, logits, mask, position, trajectory, chunk)
    losses, agree = [], []
    for t in range(trajectory.shape[1]):
        losses.append(torch.nn.functional.cross_entropy(logits.float(), trajectory[:, t], reduction="none"))
        agree.append(logits.argmax(-1) == trajectory[:, t])
        if t + 1 < trajectory.shape[1]:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            position = position + 1
            logits = model(input_ids=trajectory[:, t : t + 1], attention_mask=mask, position_ids=position,
                           use_cache=True, **{arg: cache}).logits[:, -1]
    return torch.stack(losses, dim=1), torch.stack(agree, dim=1)


def _chunked(model, arg, cache, logits, mask, position, trajectory, chunk):
    """`teacher_forced_nll` with the trajectory fed `chunk` tokens per forward (`logits`: the prompt's last)."""
    n = trajectory.shape[1]
    losses = [torch.nn.functional.cross_entropy(logits.float(), trajectory[:, 0], reduction="none")[:, None]]
    agree = [(logits.argmax(-1) == trajectory[:, 0])[:, None]]
    for start in range(0, n - 1, chunk):
        piece = trajectory[:, start : min(start + chunk, n - 1)]  # fed; predicts trajectory[:, start + 1 : ...]
        width = piece.shape[1]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], width)], dim=1)
        steps = position + torch.arange(1, width + 1, device=position.device)
        position = steps[:, -1:]
        out = model(input_ids=piece, attention_mask=mask, position_ids=steps, use_cache=True, **{arg: cache}).logits
        target = trajectory[:, start + 1 : start + 1 + width]
        losses.append(torch.nn.functional.cross_entropy(out.float().transpose(1, 2), target, reduction="none"))
        agree.append(out.argmax(-1) == target)
    return torch.cat(losses, dim=1), torch.cat(agree, dim=1)


def main():
    from transformers import DynamicCache

    from oasis_cache import OasisCache
    from oasis_cache.loaders import load_smollm2

    parser = argparse.ArgumentParser()
    parser.add_argument("--prefill", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--lookahead", default="none")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    model, tok = load_smollm2(device=args.device)
    ids = pydoc_token_ids(tok, args.prefill + args.tokens)
    model.set_attn_implementation("sdpa")
    dense = decode_nll(model, ids, args.prefill, DynamicCache(config=model.config)).mean().item()
    oasis = decode_nll(model, ids, args.prefill, OasisCache(model, token_budget=args.budget,
                                                            lookahead=args.lookahead)).mean().item()
    print(f"decode-mode NLL over {args.tokens} tokens after {args.prefill}: dense {dense:.4f}, oasis "
          f"{args.lookahead} budget {args.budget}: {oasis:.4f} (delta {oasis - dense:+.4f} nats)")


if __name__ == "__main__":
    main()
