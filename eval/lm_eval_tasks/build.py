"""Write the offline suite as lm-eval-harness tasks: one JSONL and one YAML per task (documents from
`eval/tasks.py`), into a folder to pass as `--include_path`.

    python eval/lm_eval_tasks/build.py --tasks single_needle multikey --lengths 2048 --samples 20
    python -m oasis_cache.integrations.lm_eval --model oasis \\
        --model_args pretrained=smollm2,token_budget=512,lookahead=previous \\
        --tasks oasis_single_needle,oasis_multikey --include_path eval/lm_eval_tasks/build --apply_chat_template

Task names: `oasis_<task>` (all lengths) and `oasis_<task>_<length>`. The answer primer (e.g. "The pass key is")
is the assistant prefix (`gen_prefix`), so `--apply_chat_template` starts the answer with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from eval.tasks import TASKS, generate_samples  # noqa: E402

YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}\\n\\n{{{{question}}}}"
doc_to_target: "{{{{answers[0]}}}}"
gen_prefix: "{{{{primer}}}}"
generation_kwargs:
  until: ["<|im_end|>", "\\n\\n"]
  max_gen_toks: 32
  do_sample: false
process_results: !function scoring.process_results
metric_list:
  - metric: string_match_all
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

SCORING = '''"""lm-eval metric for the oasis offline suite: RULER's string_match_all (share of answers in the output)."""


def process_results(doc, results):
    output = results[0].lower()
    return {"string_match_all": sum(a.lower() in output for a in doc["answers"]) / len(doc["answers"])}
'''


def build(out: Path, tasks: list[str], lengths: list[int], samples: int, filler: str, tokenizer) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scoring.py").write_text(SCORING)
    names = []
    for task in tasks:
        everything = []
        for length in lengths:
            docs = generate_samples(tokenizer, task, length, samples, filler=filler)
            everything += docs
            names.append(_write(out, f"oasis_{task}_{length}", docs))
        names.append(_write(out, f"oasis_{task}", everything))
    return names


def _write(out: Path, name: str, docs: list) -> str:
    data = out / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / f"{name}.yaml").write_text(YAML.format(name=name, data=data))
    return name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", nargs="+", default=sorted(TASKS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--filler", default="pydoc")
    parser.add_argument("--out", default=str(HERE / "build"))
    args = parser.parse_args()
    from oasis_cache.loaders import load_smollm2

    tokenizer = load_smollm2()[1]  # lengths are counted in SmolLM2 tokens
    names = build(Path(args.out), args.tasks, args.lengths, args.samples, args.filler, tokenizer)
    print(f"wrote {len(names)} tasks to {args.out}: {', '.join(names)}")


if __name__ == "__main__":
    main()
