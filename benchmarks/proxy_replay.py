"""The proxy's replay on the real CPU vLLM: a coding-agent session with its cache busters (tests/vllm/
agent_session.py), sent directly and through `gpuwarden proxy` on the same server, the prefix cache reset
before each replay, judged by vLLM's own vllm:prefix_cache_queries_total / _hits_total.

    python3 benchmarks/proxy_replay.py [--venv /opt/gpuwarden-test/venv-vllm] [--turns 24]

Runs it with every rule on (the date line too) and with the shipped defaults (date_line off), and prints a
Markdown table for benchmarks/RESULTS.md.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
import agent_session  # noqa: E402
from proxy_rig import FULL_RULES, Rig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPUWARDEN_VLLM_VENV",
                                                                        "/opt/gpuwarden-test/venv-vllm")))
    parser.add_argument("--turns", type=int, default=24)
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(model)],
                       check=True, capture_output=True, timeout=300)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "daemon")}
        for rules_name, rules in (("all rules", FULL_RULES), ("defaults (date_line off)", ())):
            rig = Rig(python, model, Path(tmp), proxy_args=rules, env=env)
            try:
                for api in ("anthropic", "openai"):
                    for route, base in (("direct", rig.engine), ("proxy", rig.proxy)):
                        if route == "direct" and rows and any(r["api"] == api and r["route"] == "direct" for r in rows):
                            continue  # the direct replay does not depend on the proxy's rules
                        agent_session.reset_cache(rig.engine)
                        result = agent_session.replay(base, rig.engine, api, "tiny", args.turns)
                        rows.append({**result, "route": route, "rules": rules_name if route == "proxy" else "-"})
                        print(rows[-1], file=sys.stderr)
            finally:
                rig.stop()
    print("| API | route | proxy rules | turns | prompt tokens, first → last turn | tokens looked up | hits "
          "| hit rate | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['api']} | {r['route']} | {r['rules']} | {r['turns']} | {r['first_prompt_tokens']} → "
              f"{r['last_prompt_tokens']} | {r['queries']:.0f} | {r['hits']:.0f} | {100 * r['hit_rate']:.1f} % | "
              f"{r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
