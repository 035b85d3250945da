"""Install a head trained on the GPU machine (`bash bench/gpu_run.sh train`: its `head/` folder under `$OUT`) as a
shipped head: `oasis_cache/draft/heads/<name>/`.

    python bench/install_head.py --parts DIR --name qwen2.5-coder-0.5b-instruct \
        --trained "2026-12-03, one H200, ...: <the command>" --data "<what the texts were>" --recall "<result files>"

DIR is the run's `head/` folder: `part*` (the bf16 safetensors cut in 15 MB pieces), `metrics.json`, and
`config.json` / `target.json` (a run that started from a shipped head has neither: they are kept from the head it
replaces). Joins the parts, checks the result loads as an EAGLE-3 head of the same shape as `config.json` says and
stays within `--max-mb` (the issue's 40 MB), and writes `metrics.json` with the given provenance. Nothing is replaced
until every check passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oasis_cache.draft import load_eagle3  # noqa: E402

HEADS = Path(__file__).resolve().parent.parent / "oasis_cache" / "draft" / "heads"


def install(parts: Path, name: str, provenance: dict, max_mb: float = 40.0, heads: Path = HEADS) -> Path:
    """Assemble `parts` into `heads/name` (see the module's docstring); returns the head's directory."""
    pieces = sorted(parts.glob("part*"))
    if not pieces:
        raise SystemExit(f"{parts}: no part* files (the safetensors pieces `gpu_run.sh train` writes)")
    old = heads / name
    with tempfile.TemporaryDirectory() as tmp:
        new = Path(tmp) / name
        new.mkdir()
        with open(new / "model.safetensors", "wb") as out:
            for piece in pieces:
                out.write(piece.read_bytes())
        for kept in ("config.json", "target.json"):
            source = parts / kept if (parts / kept).exists() else old / kept
            if not source.exists():
                raise SystemExit(f"no {kept} in {parts} nor in {old}: a head needs one")
            shutil.copyfile(source, new / kept)
        size = (new / "model.safetensors").stat().st_size / 1e6
        if size > max_mb:
            raise SystemExit(f"the head's weights take {size:.1f} MB, over --max-mb {max_mb}")
        head = load_eagle3(new)  # reads the checkpoint, checks its tensors against config.json
        metrics = json.loads((parts / "metrics.json").read_text()) if (parts / "metrics.json").exists() else {}
        metrics.update({k: v for k, v in provenance.items() if v})
        metrics["size_mb"] = round(size, 1)
        (new / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        print(f"{name}: {head.config.num_hidden_layers} layer(s), draft vocabulary {head.config.draft_vocab_size}, "
              f"{size:.1f} MB; top-1 agreement {metrics.get('top1_agreement')}")
        if old.exists():
            shutil.rmtree(old)
        shutil.copytree(new, old)
    return old


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", required=True, type=Path, help="the run's head/ folder")
    parser.add_argument("--name", required=True, help="the shipped head's folder under oasis_cache/draft/heads")
    parser.add_argument("--trained", required=True, help="when, where and the exact command")
    parser.add_argument("--data", default=None, help="what the training texts were")
    parser.add_argument("--recall", default=None, help="the recall result files measured with it")
    parser.add_argument("--max-mb", type=float, default=40.0)
    args = parser.parse_args(argv)
    install(args.parts, args.name, dict(trained=args.trained, data=args.data, recall=args.recall), args.max_mb)


if __name__ == "__main__":
    main()
