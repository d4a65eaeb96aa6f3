"""examples/rl_loop.py runs end to end: train step -> refit -> generate -> rollouts, 3 steps."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rl_loop_example():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "rl_loop.py"), "--steps", "3"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rl_loop: ok, 3 steps" in out.stdout
    # Each step's rollouts were generated with the weights of that step's refit.
    rewards = [
        float(m.group(2))
        for m in re.finditer(r"rollouts of weight version step-(\d): mean reward ([0-9.]+)", out.stdout)
    ]
    assert len(rewards) == 3, out.stdout
    assert rewards[-1] > rewards[0], out.stdout  # the toy policy learned from its rollouts
