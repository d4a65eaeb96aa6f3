"""One timeline of every rank's REFIT_LOG=debug lines, per refit step.

    python3 timeline.py LOG [STEPS]

LOG holds the stderr of `refit bench` or `refit run` under REFIT_LOG=debug, whose lines carry
wall-clock times ("[refit trainer 0 1733061234.123456] ..."). Prints the last STEPS steps
(default 2): each line naming the step, in time order, in ms after the trainer sent its begin.
"""
import re
import sys

LINE = re.compile(r"\[refit ([^\]]*?) (\d+\.\d+)\] (.*)")
STEP = re.compile(r"(?:refit step|of step|step) (\d+)")


def main():
    path, last = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    steps = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            s = STEP.search(m.group(3)) if m else None
            if s:
                steps.setdefault(int(s.group(1)), []).append(
                    (float(m.group(2)), m.group(1), m.group(3)))
    for step in sorted(steps)[-last:]:
        lines = sorted(steps[step])
        t0 = next((t for t, _, msg in lines if "sent the begin" in msg), lines[0][0])
        print(f"timeline of step {step} (ms after the trainer sent the begin)")
        for t, who, msg in lines:
            print(f"  {1e3 * (t - t0):8.3f}  {who:12} {msg[:110]}")


if __name__ == "__main__":
    main()
