"""The decode benchmark keeps working (tiny random model, CPU): each method's row, and `--interleave` (methods take
turns step by step) computes what one-after-the-other computes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_decode_bench(tmp_path, *extra):
    out = tmp_path / f"decode{len(extra)}.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decode.py"), "--model", "tiny", "--device", "cpu", "--contexts", "512",
         "--batches", "2", "--steps", "3", "--warmup", "1", "--measure-steps", "2", "--budget", "256",
         "--methods", "dense", "oasis-none", "oasis-previous", "oasis-eagle3", *extra, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_interleaved_decode_bench_measures_what_sequential_measures(tmp_path):
    alone = run_decode_bench(tmp_path)
    turns = run_decode_bench(tmp_path, "--interleave")
    assert turns["meta"]["interleave"] and not alone["meta"]["interleave"]
    assert [r["method"] for r in turns["rows"]] == ["dense", "oasis-none", "oasis-previous", "oasis-eagle3"]
    for a, b in zip(alone["rows"], turns["rows"]):
        assert a["method"] == b["method"] and b["tpot_ms"] > 0
        for key in ("bytes_fetched_per_step", "hit_rate", "prediction_recall", "tokens_attended_per_step",
                    "kv_device_gib"):
            assert a.get(key) == b.get(key), (a["method"], key, a.get(key), b.get(key))
    assert turns["rows"][2]["prediction_recall"] is not None  # previous was measured
