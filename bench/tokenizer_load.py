"""What the API process pays for its tokenizer: transformers' AutoTokenizer (which imports torch, transformers 5)
against node/trainer/light_tokenizer.py (tokenizers + jinja2), side by side in one run on the same model
directories: the character tokenizer of the tiny demo model and, where cached, SmolLM2-135M-Instruct's.

Each side runs in a fresh interpreter: import + load time, peak RSS after the load (ru_maxrss), whether torch got
imported, and the CPU per `encode_prompt` (what /v1/work does for each prompt it hands out) and per
`decode_completion` (what intake does for each completion it scores), over prompts of every built-in task.

    .venv/bin/python bench/tokenizer_load.py [--reps 2000]
Writes bench/results/tokenizer_load.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results"

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
kind, model_dir, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "transformers":
    from node.trainer.tokenizer import load_tokenizer as load
else:
    from node.trainer.light_tokenizer import load_light_tokenizer as load
tok = load(model_dir)
load_s = time.perf_counter() - t0
rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from node.envs import BUILTIN_TASKS, load_task, encode_prompt, decode_completion
problems = [load_task(n, {}).sample(0, i) for n in sorted(BUILTIN_TASKS) for i in range(50)]
completions = [tok(str(p.answer) + " because 12 + 30 = 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
               for p in problems]
def per_call(fn, items):
    t = time.process_time()
    for k in range(reps):
        fn(tok, items[k % len(items)])
    return (time.process_time() - t) / reps * 1e6
print(json.dumps({"load_s": load_s, "peak_rss_mib": rss_mib, "torch": "torch" in sys.modules,
                  "encode_prompt_us": per_call(encode_prompt, problems),
                  "decode_completion_us": per_call(decode_completion, completions)}))
"""


def run(kind: str, model_dir: Path, reps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(model_dir), str(reps)], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2000)
    args = ap.parse_args()
    dirs: dict[str, Path] = {}
    tmp = tempfile.TemporaryDirectory()
    from node.trainer.tokenizer import build_char_tokenizer

    char = Path(tmp.name) / "char"
    build_char_tokenizer().save_pretrained(str(char))
    (char / "config.json").write_text(json.dumps({"model_type": "llama"}))
    dirs["char (tiny demo)"] = char
    try:
        from node.real_model import model_dir

        dirs["SmolLM2-135M-Instruct"] = model_dir(download=False)
    except Exception as e:  # not cached: measured on the char tokenizer only
        print(f"SmolLM2 not measured: {e}", file=sys.stderr)
    rows = []
    for name, d in dirs.items():
        sides = {kind: run(kind, d, args.reps) for kind in ("transformers", "light")}
        rows.append({"tokenizer": name, **{f"{k}": v for k, v in sides.items()}})
    print(f"{'tokenizer':24} {'side':13} {'load s':>7} {'peak RSS MiB':>13} {'torch':>6} {'encode_prompt us':>17} "
          f"{'decode us':>10}")
    for r in rows:
        for kind in ("transformers", "light"):
            s = r[kind]
            print(f"{r['tokenizer']:24} {kind:13} {s['load_s']:7.2f} {s['peak_rss_mib']:13.0f} {str(s['torch']):>6} "
                  f"{s['encode_prompt_us']:17.1f} {s['decode_completion_us']:10.1f}")
        t, lt = r["transformers"], r["light"]
        print(f"{'':24} {'ratio t/light':13} {t['load_s'] / lt['load_s']:7.1f} {t['peak_rss_mib'] / lt['peak_rss_mib']:13.1f} "
              f"{'':>6} {t['encode_prompt_us'] / lt['encode_prompt_us']:17.2f} "
              f"{t['decode_completion_us'] / lt['decode_completion_us']:10.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tokenizer_load.json").write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
