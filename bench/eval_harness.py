"""lm-evaluation-harness against `mstrace serve` and against lm-eval's own `hf` backend.

One loglikelihood task (multiple choice, `mstrace_mc`) and one `generate_until` task
(`mstrace_gen`), both defined in bench/eval_tasks/ as lm-eval task YAMLs on a JSONL
shipped beside them (`dataset_path: json`, `data_files` relative to the repository
root; the script runs from there), are evaluated twice on the same model folder:

  hf      lm-eval's `hf` backend, in this process: transformers' AutoModelForCausalLM,
          dtype=float32, device=cpu, batch_size=1.
  server  lm-eval's `local-completions` backend against `mstrace serve --model MODEL
          --device cpu --dtype float32`, started here on a free loopback port:
          tokenizer=<the folder> (huggingface backend), tokenized_requests=True (the
          prompts go as token-id lists, so the server scores exactly the ids lm-eval
          made), num_concurrent=1, max_retries=1, batch_size=1 (--batch-size N sends N
          prompts per request, a batch as a list).

Loglikelihood over the API (lm-eval 0.4.13, models/openai_completions.py): each request
is {prompt: [[ids]], max_tokens: 1, echo: true, logprobs: 1, temperature: 0, seed}; the
continuation's log-likelihood is sum(choices[i].logprobs.token_logprobs[ctxlen:-1]) (the
echoed prompt's entries, less the context's and the one generated token's), and
is_greedy compares each of them with max(top_logprobs[j].values()).

BOS. The preset's tokenizer adds <s> by default (tokenizer_config add_bos_token: true).
lm-eval's `hf` backend, left at add_bos_token=None, follows the tokenizer and prepends
it; the API backend's default is add_bos_token=False, which encodes with
add_special_tokens=False and sends no BOS (the server adds nothing to a token-id prompt).
Left at their defaults the two would score different sequences. Both get
add_bos_token=True here, so both score <s> + context + continuation (and generate
from <s> + context): the sequence a Llama-family model is trained on, and what the
server itself makes of a text prompt (add_special_tokens defaults to true there).

The comparison, per sample (matched by task and doc_id; the prompts must be equal):
  multiple choice  the chosen answer (argmax of the choices' log-likelihoods) is the
                   same, and every choice's log-likelihood agrees within --tol (1e-3);
  generate_until   the generated text (after lm-eval's stop-string cut) is identical.
It prints both backends' scores, the max |delta loglikelihood|, the mismatch count, and
exits 1 when anything differs (2 when a run could not finish). is_greedy disagreements
are counted and printed but do not fail the run.

    .venv/bin/python bench/eval_harness.py                  # tiny preset, ~1 min on 2 cores
    .venv/bin/python bench/eval_harness.py --batch-size 4   # the server gets 4 prompts a request

Needs the bench extra (pip install -e '.[bench]': lm-eval[api], accelerate). Writes the
per-sample comparison to bench/out/eval_harness.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "bench" / "eval_tasks"
TASKS = ["mstrace_mc", "mstrace_gen"]
OUT = REPO / "bench" / "out" / "eval_harness.json"


# --- the server ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


class Server:
    """`mstrace serve` as a subprocess: up when /health answers 200, down on SIGINT."""

    def __init__(self, model: str, port: int, workdir: Path, extra: list[str]) -> None:
        self.port, self.log_path = port, workdir / "server.log"
        self.base = f"http://127.0.0.1:{port}"
        exe = Path(sys.executable).with_name("mstrace")
        cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "viewer.cli"]),
               "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--dtype", "float32", "--out", str(workdir / "trace"), "--force", *extra]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        # its own session: a Ctrl-C at the terminal does not reach it before stop() does
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mstrace serve exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if get_json(self.base + "/health", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"mstrace serve: /health not 200 after {timeout:.0f}s:\n{self.log_tail()}")

    def model_name(self) -> str:
        status, body = get_json(self.base + "/v1/models")
        if status != 200 or not body or not body.get("data"):
            raise RuntimeError(f"GET /v1/models: {status} {body}")
        return str(body["data"][0]["id"])

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# --- the two runs ----------------------------------------------------------------------------

_last_payload: dict[str, Any] = {}


def _record_payloads() -> None:
    """Keep the last request body the API backend built, to print it if the server refuses one."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    make = LocalCompletionsAPI._create_payload
    if getattr(make, "_recorded", False):
        return

    def recorded(self: Any, *a: Any, **kw: Any) -> dict[str, Any]:
        body: dict[str, Any] = make(self, *a, **kw)
        _last_payload.clear()
        _last_payload.update(body)
        return body

    recorded._recorded = True  # type: ignore[attr-defined]
    LocalCompletionsAPI._create_payload = recorded


def evaluate(model: str, model_args: dict[str, Any], batch_size: int, limit: int | None) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR))
    res: dict[str, Any] | None = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=tm,
                                  batch_size=batch_size, device="cpu", limit=limit, log_samples=True,
                                  bootstrap_iters=0)
    if res is None:
        raise RuntimeError("simple_evaluate returned nothing")
    return res


# --- the comparison --------------------------------------------------------------------------

def scores(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for task, r in res["results"].items():
        out[task] = {k.split(",")[0]: v for k, v in r.items()
                     if "," in k and "stderr" not in k and isinstance(v, int | float)}
    return out


def compare(hf: dict[str, Any], api: dict[str, Any], tol: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    max_dll, mismatches, greedy_diff, n_ll = 0.0, 0, 0, 0
    for task in TASKS:
        a = {s["doc_id"]: s for s in hf["samples"][task]}
        b = {s["doc_id"]: s for s in api["samples"][task]}
        if a.keys() != b.keys():
            rows.append({"task": task, "problem": f"doc_ids differ: hf {sorted(a)} server {sorted(b)}"})
            mismatches += 1
        for doc_id in sorted(a.keys() & b.keys()):
            sa, sb = a[doc_id], b[doc_id]
            row: dict[str, Any] = {"task": task, "doc_id": doc_id, "problems": []}
            if json.dumps(sa["arguments"], default=str) != json.dumps(sb["arguments"], default=str):
                row["problems"].append("the prompts differ")
            ra, rb = sa["filtered_resps"], sb["filtered_resps"]
            if task == "mstrace_mc":
                lla, llb = [float(x[0]) for x in ra], [float(x[0]) for x in rb]
                ga, gb = [bool(x[1]) for x in ra], [bool(x[1]) for x in rb]
                ca, cb = max(range(len(lla)), key=lla.__getitem__), max(range(len(llb)), key=llb.__getitem__)
                d = max(abs(x - y) for x, y in zip(lla, llb, strict=True))
                n_ll += len(lla)
                max_dll = max(max_dll, d)
                row.update(hf_ll=lla, server_ll=llb, hf_choice=ca, server_choice=cb, max_dll=d,
                           hf_greedy=ga, server_greedy=gb)
                if ca != cb:
                    row["problems"].append(f"chosen answer {ca} (hf) vs {cb} (server)")
                if d > tol:
                    row["problems"].append(f"|delta ll| {d:.3g} > {tol:g}")
                greedy_diff += sum(x != y for x, y in zip(ga, gb, strict=True))
            else:
                ta, tb = ra[0], rb[0]
                row.update(hf_text=ta, server_text=tb)
                if ta != tb:
                    row["problems"].append("generated text differs")
            mismatches += bool(row["problems"])
            rows.append(row)
    return {"rows": rows, "max_dll": max_dll, "mismatches": mismatches, "greedy_diff": greedy_diff,
            "n_ll": n_ll, "n_samples": sum(1 for r in rows if "doc_id" in r)}


def print_report(sc_hf: dict[str, dict[str, float]], sc_api: dict[str, dict[str, float]],
                 cmp: dict[str, Any], tol: float) -> None:
    print()
    print(f"{'task':<13} {'metric':<12} {'hf':>8} {'server':>8}")
    for task in TASKS:
        for metric in sc_hf.get(task, {}):
            print(f"{task:<13} {metric:<12} {sc_hf[task][metric]:>8.4f} {sc_api.get(task, {}).get(metric, float('nan')):>8.4f}")
    print()
    print(f"samples compared: {cmp['n_samples']} ({cmp['n_ll']} loglikelihoods)")
    print(f"max |delta loglikelihood|: {cmp['max_dll']:.3g} (tolerance {tol:g})")
    print(f"is_greedy disagreements: {cmp['greedy_diff']} (informational)")
    print(f"mismatched samples: {cmp['mismatches']}")
    shown = 0
    for r in cmp["rows"]:
        if not (r.get("problems") or r.get("problem")) or shown >= 10:
            continue
        shown += 1
        print(f"  {r['task']} doc {r.get('doc_id')}: {'; '.join(r.get('problems') or [r.get('problem', '')])}")
        if "hf_text" in r:
            print(f"    hf:     {r['hf_text']!r}\n    server: {r['server_text']!r}")
        elif "hf_ll" in r:
            print(f"    hf:     {[round(x, 5) for x in r['hf_ll']]}\n    server: {[round(x, 5) for x in r['server_ll']]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="preset name or a local HF Llama-family folder")
    ap.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    ap.add_argument("--tol", type=float, default=1e-3, help="max |delta loglikelihood| allowed")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per request to the server")
    ap.add_argument("--limit", type=int, default=None, help="first N samples of each task")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--trace-out", type=Path, default=None, help="keep the server's log and trace here")
    ap.add_argument("--out", type=Path, default=OUT, help="per-sample comparison (JSON)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `mstrace serve` argument")
    args = ap.parse_args()

    t0 = time.monotonic()
    # paths given on the command line are the caller's, before the chdir below
    args.out = args.out.resolve()
    args.trace_out = args.trace_out.resolve() if args.trace_out is not None else None
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    os.chdir(REPO)  # the task YAMLs' data_files are relative to the repository root
    sys.path.insert(0, str(REPO))
    from scheduler.model.presets import resolve_model

    folder = str(resolve_model(args.model))
    print(f"model folder: {folder}")

    t = time.monotonic()
    hf_res = evaluate("hf", {"pretrained": folder, "dtype": "float32", "add_bos_token": True}, 1, args.limit)
    print(f"hf backend: {time.monotonic() - t:.1f}s")

    tmp = None
    if args.trace_out is None:
        tmp = tempfile.TemporaryDirectory(prefix="eval_harness-")
        workdir = Path(tmp.name)
    else:
        workdir = args.trace_out
        workdir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    server = Server(args.model, port, workdir, args.server_arg)
    rc = 0
    try:
        t = time.monotonic()
        server.wait_healthy(args.startup_timeout)
        name = server.model_name()
        print(f"server: mstrace {' '.join(server.cmd[server.cmd.index('serve'):])}"
              f" (up in {time.monotonic() - t:.1f}s, model {name!r})")
        _record_payloads()
        api_args = {"model": name, "base_url": f"{server.base}/v1/completions", "tokenizer": folder,
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": True,
                    "num_concurrent": 1, "max_retries": 1, "timeout": 120}
        t = time.monotonic()
        try:
            api_res = evaluate("local-completions", api_args, args.batch_size, args.limit)
        except Exception as e:
            body = json.dumps(_last_payload)
            print(f"\nserver run failed: {type(e).__name__}: {e}", file=sys.stderr)
            resp = getattr(e, "response", None)
            if resp is not None:
                print(f"response {resp.status_code}: {resp.text[:2000]}", file=sys.stderr)
            print(f"last request body: {body[:2000]}", file=sys.stderr)
            print(f"server log:\n{server.log_tail()}", file=sys.stderr)
            return 2
        print(f"server backend: {time.monotonic() - t:.1f}s")
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        rc = 2
        return rc
    finally:
        code = server.stop()
        if code not in (0, 130, -signal.SIGINT) and rc == 0:
            print(f"mstrace serve exited {code}:\n{server.log_tail()}", file=sys.stderr)
            rc = 2
        if tmp is not None:
            tmp.cleanup()

    sc_hf, sc_api = scores(hf_res), scores(api_res)
    cmp = compare(hf_res, api_res, args.tol)
    print_report(sc_hf, sc_api, cmp, args.tol)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "folder": folder, "tol": args.tol,
                                    "batch_size": args.batch_size, "scores": {"hf": sc_hf, "server": sc_api},
                                    **cmp}, indent=1, default=str))
    ok = cmp["mismatches"] == 0 and rc == 0
    print(f"\n{'PASS' if ok else 'FAIL'}: wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
          f" ({time.monotonic() - t0:.1f}s)")
    return 0 if ok else (rc or 1)


if __name__ == "__main__":
    sys.exit(main())
