"""This tree and an earlier commit side by side: a checkout of the commit, and worker processes
(one per tree, each with its own `import jaxmtp`) that answer one JSON line per request, so that a
caller can run them in turn and a shared machine's drifts hit both alike."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def checkout(rev: str):
    """A detached worktree of `rev` for the duration (its path)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)


def start_worker(script: str, tree: str, args: list[str]) -> subprocess.Popen:
    """`script --worker *args` importing jaxmtp from `tree`; returns once it has said it is ready."""
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--worker", *args], cwd=tree, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(proc.stdout.readline())["ready"], f"worker in {tree} did not start"
    return proc


def serve(answer):
    """The worker's side: says it is ready, then answers each request line with answer(line)."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(line.strip())), flush=True)


def ask(proc: subprocess.Popen, request: str) -> dict:
    proc.stdin.write(request + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def stop(workers):
    for proc in workers:
        proc.stdin.close()
        proc.wait()
