"""Which transformers architectures OasisCache serves. Every causal LM the installed transformers ships is built
tiny with random weights (`tiny_model_of`) and generates greedily — SDPA + DynamicCache, then OasisCache with a
budget above the context, its prompt in one forward and in the cache's own chunks (`compare`) — and lands in one row:

- `equal`: the same tokens, logits within `ATOL` (the exactness contract), both ways;
- `refused`: OasisCache raised, naming why (at construction, or at the first forward for what only the forward shows:
  a model that attends tensors other than those it wrote into the cache);
- `MISMATCH`: other tokens or logits, silently — a bug (none at the last run);
- `not built`: the tiny config did not give a model that generates densely (towers needing other libraries,
  encoder-only flags, configs whose fields the small shape contradicts): nothing is said about OasisCache there.

Multimodal models are built whole (their vision / audio towers small) and prompted with text; `tests/integration/test_multimodal.py`
prompts Gemma 3 with images.

    python eval/architectures.py                          # every causal LM, two at a time, one process each
    python eval/architectures.py --types llama qwen3_5_text gpt_oss
    python eval/architectures.py --out docs/models.md      # the table, with the command, date and versions
    python eval/architectures.py --multimodal --out docs/models_multimodal.md  # image-text-to-text models

Each model runs in its own process (a few tiny configs still allocate gigabytes: one per process, under `--memory`).
`tests/integration/test_architectures.py` runs a fixed list of them with `compare` in CI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WINDOW = 32  # tokens of a sliding-window layer beside full-attention ones
ATOL = 1e-3  # fp32 logits of random tiny models: sums in another order than SDPA's
PROMPT = 150  # tokens: nine blocks of 16 in the host pool beside the sink and recent tokens
NEW_TOKENS = 12
CHUNK = 64  # tokens a prefill forward of the cache's own chunks (`prefill_chunk_tokens`): the prompt in three forwards
# A small shape under every attribute name the configs use for it (only those a config has are set).
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=4096, moe_intermediate_size=32, num_experts=4,
             num_local_experts=4, num_experts_per_tok=2, n_routed_experts=4, shared_expert_intermediate_size=64,
             d_model=64, n_layer=4, n_head=4, n_embd=64, num_layers=4, num_heads=4, is_decoder=True,
             first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, ffn_hidden_size=128,
             kv_channels=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=8, kv_lora_rank=32,
             q_lora_rank=48, n_group=1, topk_group=1, rotary_dim=16, mamba_n_heads=8, mamba_d_head=16,
             mamba_d_state=16, mamba_chunk_size=32, n_mamba_heads=8, mamba_headdim=16, n_shared_experts=1,
             mamba_d_ssm=128, attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=4,
             indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4)
# A multimodal model's towers (`vision_config`, `audio_config`), small: the sweep's prompts are text only.
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
             patch_size=14)


def tiny_model_of(model_type: str, seed: int = 0, is_decoder: bool = True):
    """A random `[model_type]` causal LM of `SMALL` shape (`is_decoder=True`: BERT-like models attend causally),
    in eval mode on SDPA (eager where it has none: `model.dense_attention`); its layer kinds (`layer_types`) spread
    over its four layers, one of them full attention where the model has any, sliding windows of `WINDOW`."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    whole = AutoConfig.for_model(model_type)  # (a multimodal model's: its text config inside, its towers small)
    config = whole.get_text_config(decoder=True)
    for name in ("vision_config", "audio_config"):
        for key, value in TOWER.items():
            if hasattr(getattr(whole, name, None), key):
                setattr(getattr(whole, name), key, value)
    for name, value in {**SMALL, "is_decoder": is_decoder}.items():
        try:  # (a per-layer attribute, Gemma 4's head_dim, raises even to `hasattr`: set below)
            if hasattr(config, name):
                setattr(config, name, value)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # (a derived property)
            pass
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "mrope_section" in getattr(config, "ignore_keys_at_rope_validation", ()):
        width = getattr(config, "attention_head_dim", None) or SMALL["head_dim"]  # (HunYuan-VL's heads: that one)
        half = int(width * rope.get("partial_rotary_factor", 1.0)) // 2  # (multimodal rotary: the
        rope["mrope_section"] = [half // 4, half // 4, half - 2 * (half // 4)]  # half head's three sections)
    for name, value in (("attn_layer_indices", [1, 3]), ("attn_layer_period", 2), ("attn_layer_offset", 1),
                        ("hybrid_layer_ids", [1, 3])):
        if hasattr(config, name):  # (hybrids that place their attention layers by index: one in the four)
            setattr(config, name, value)
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads  # (MLA: keys and values made per query head)
    if hasattr(config, "layer_types") and config.layer_types is None and config.model_type.startswith("lfm2"):
        config.layer_types = ["conv", "full_attention"] * 2  # (LFM2-MoE's default config names none)
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    if kinds == ["linear_attention"]:  # (a hybrid whose default config lists no attention layer: Granite 4)
        kinds = ["linear_attention", "full_attention"]
    if kinds:
        layer_types = [kinds[i % len(kinds)] for i in range(4)]
        if "full_attention" in kinds and "full_attention" not in layer_types:
            layer_types[-1] = "full_attention"
        try:
            config.layer_types = layer_types
        except (AttributeError, TypeError, ValueError):  # (derived from other fields: the model's own spread)
            pass
        if any("sliding" in kind for kind in kinds) and isinstance(getattr(config, "sliding_window", None), int):
            config.sliding_window = WINDOW  # (a window the prompt passes)
        if "chunked_attention" in kinds and isinstance(getattr(config, "attention_chunk_size", None), int):
            config.attention_chunk_size = WINDOW  # (chunks the prompt and the new tokens cross: Llama 4's 8,192)
        if config.to_dict().get("per_layer_config"):  # (Gemma 4: its full layers' wider heads, made anew: a
            settings = config.to_dict()  # per-layer setting takes effect at construction only)
            for key in ("model_type", "transformers_version", "architectures"):
                settings.pop(key, None)
            settings.update(head_dim=SMALL["head_dim"], per_layer_config={
                f"{i:02d}": {"head_dim": 2 * SMALL["head_dim"]} for i, kind in enumerate(config.layer_types)
                if kind == "full_attention"})
            whole, config = (type(config)(**settings),) * 2 if whole is config else (whole, type(config)(**settings))
            if whole is not config:
                whole.text_config = config
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    torch.manual_seed(seed)
    model_class = getattr(transformers, arch[0] if isinstance(arch, (list, tuple)) else arch)
    # (a multimodal class takes the whole config; a text-only class of a multimodal family, its text config)
    model = model_class(whole if isinstance(whole, model_class.config_class) else config).eval()
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:  # (no SDPA path: gpt-oss's sinks, ...) dense runs eagerly
        model.set_attn_implementation("eager")
    model.dense_attention = model.config._attn_implementation
    return model


def compare(model, prompt: int = PROMPT, new_tokens: int = NEW_TOKENS) -> tuple[str, str]:
    """`(result, detail)` of a greedy `generate` through SDPA + DynamicCache and through OasisCache (budget above
    the context) twice — the prompt in one forward, and in the cache's own chunks of `CHUNK` tokens: "equal" (both),
    "MISMATCH", "refused" (OasisCache's error) or "not built" (dense failed)."""
    from transformers import DynamicCache

    from oasis_cache import OasisCache

    from oasis_cache.compat import layer_types_and_kwargs

    windows = [kw.get("sliding_window") for _, kw in layer_types_and_kwargs(model.config.get_text_config(decoder=True))]
    wide = [w for w in windows if isinstance(w, int) and w >= prompt]  # (equal within a window says nothing
    ids = torch.randint(3, 200, (1, prompt), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0, eos_token_id=None)
    try:
        dense = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    except Exception as error:  # noqa: BLE001  (the tiny config does not run: nothing to compare)
        return "not built", f"dense generate: {type(error).__name__}: {error}"
    same, worst = [], []
    for chunk in (0, CHUNK):
        try:
            cache = OasisCache(model, token_budget=4 * (prompt + new_tokens), prefill_chunk_tokens=chunk)
            oasis = model.generate(ids, past_key_values=cache, **kw)
        except (NotImplementedError, ValueError) as error:
            return "refused", f"{type(error).__name__}: {error}" + (f" (in chunks of {chunk})" if chunk else "")
        finally:
            model.set_attn_implementation(getattr(model, "dense_attention", "sdpa"))
        worst.append(max((a - b).abs().max().item() for a, b in zip(dense.logits, oasis.logits)))
        same.append(torch.equal(dense.sequences, oasis.sequences))
    result = "equal" if all(same) and max(worst) <= ATOL else "MISMATCH"
    if result == "equal" and wide:  # about the tokens past it: the sweep's shapes must cross every window and chunk)
        return "not built", f"a window or chunk of {max(wide)} tokens the {prompt}-token prompt does not cross"
    return result, (f"tokens equal: {same[0]} / {same[1]} in chunks; max |logit diff| {worst[0]:.1e} / "
                    f"{worst[1]:.1e}")


def _one(model_type: str) -> dict:
    row = {"type": model_type}
    try:
        model = tiny_model_of(model_type)
    except Exception as error:  # noqa: BLE001
        return {**row, "class": "", "result": "not built", "detail": f"{type(error).__name__}: {error}"}
    row["class"] = type(model).__name__
    row["result"], row["detail"] = compare(model)
    return row


def _in_subprocess(model_type: str, memory: int, timeout: int) -> dict:
    command = ["prlimit", f"--as={memory}", sys.executable, __file__, "--one", model_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "class": "", "result": "not built", "detail": f"over {timeout} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"type": model_type, "class": "", "result": "not built", "detail": tail}
    return json.loads(lines[-1])


def table(rows: list[dict], command: str, which: str = "Every causal LM") -> str:
    import transformers

    counts = {result: sum(row["result"] == result for row in rows) for result in
              ("equal", "refused", "MISMATCH", "not built")}
    lines = ["# Architectures", "",
             f"{which} of transformers {transformers.__version__} (torch {torch.__version__}), tiny with "
             f"random weights, a {PROMPT}-token prompt and {NEW_TOKENS} greedy tokens: OasisCache (budget above the "
             f"context; the prompt in one forward, then in the cache's own chunks of {CHUNK} tokens) against SDPA + "
             "DynamicCache. Made by `eval/architectures.py` (its docstring says what each "
             f"result means): `{command}`, {platform.machine()} CPU, {datetime.date.today().isoformat()}.", "",
             ", ".join(f"{n} {result}" for result, n in counts.items()) + ".", "",
             "| model_type | class | result | detail |", "| --- | --- | --- | --- |"]
    for row in rows:
        detail = row["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['type']} | {row['class']} | {row['result']} | {detail[:220]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every causal LM transformers ships)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory", type=int, default=10 * 2**30, help="address-space limit per model's process")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per model")
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--multimodal", action="store_true",
                        help="the image-text-to-text models that are not causal LMs of their own (text prompts)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (the per-model process: prints its row as JSON)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.one:
        print(json.dumps(_one(args.one)), flush=True)
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.multimodal:  # (image-text-to-text models transformers does not list as causal LMs: text prompts too)
        types = sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    with ThreadPoolExecutor(args.workers) as pool:
        rows = []
        for row in pool.map(lambda t: _in_subprocess(t, args.memory, args.timeout), types):
            print(f"{row['type']:28s} {row['class']:36s} {row['result']:9s} {row['detail'][:150]}", flush=True)
            rows.append(row)
    command = "python eval/architectures.py" + (f" --types {' '.join(args.types)}" if args.types else "") + \
        (" --multimodal" if args.multimodal else "") + \
        (f" --out {args.out}" if args.out else "")
    if args.out:
        which = ("Every image-text-to-text model (not also a causal LM), prompted with text," if args.multimodal
                 else "Every causal LM")
        Path(args.out).write_text(table(rows, command, which))


if __name__ == "__main__":
    main()
