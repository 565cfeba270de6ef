"""Which torch `dev.sh` installs, printed as pip arguments, one a line.

Without a GPU the CPU build, pinned by its local version (`+cpu`) so that pip can never take PyPI's CUDA build
(several GB of nvidia wheels) instead; the CPU wheel index is added only when it answers, so a machine that
reaches only its own package mirror (or has the wheel on disk) is neither slowed nor failed by it. Runs with
the system python3 before the venv exists: standard library only.

Environment: RELAUNCH_TORCH_INDEX, the CPU wheel index (default below; empty: use only the indexes pip is
configured with).
"""
import os
import shutil
import subprocess
import sys
import threading
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_CPU = "torch==2.13.0+cpu"
TORCH_GPU = "torch>=2.6,<2.14"  # the GPU wheel from the default index, its CUDA build
PROBE_SECS = 5.0


def torch_pip_args(has_gpu: bool, cpu_index: str, index_answers: bool) -> list[str]:
    """The pip arguments that install torch: the CUDA build with a GPU, else the CPU build (from the CPU wheel
    index when one is set and answers, else from whatever pip is configured with)."""
    if has_gpu:
        return [TORCH_GPU]
    if cpu_index and index_answers:
        return ["--extra-index-url", cpu_index, TORCH_CPU]
    return [TORCH_CPU]


def has_gpu() -> bool:
    """An NVIDIA GPU that the driver lists (nvidia-smi installed without a GPU does not count)."""
    if shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return listed.returncode == 0 and "GPU" in listed.stdout


def answers(index: str) -> bool:
    """Whether the index serves torch within PROBE_SECS (a thread bounds DNS too, which urlopen's timeout does not)."""
    result = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=PROBE_SECS) as reply:
                result.append(reply.status == 200)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(PROBE_SECS)
    return bool(result and result[0])


def main() -> None:
    gpu = has_gpu()
    index = os.environ.get("RELAUNCH_TORCH_INDEX", CPU_INDEX)
    reachable = not gpu and bool(index) and answers(index)
    args = torch_pip_args(gpu, index, reachable)
    if gpu:
        print("dev.sh: a GPU is present: torch's CUDA build", file=sys.stderr)
    elif index and not reachable:
        print(f"dev.sh: {index} does not answer; {TORCH_CPU} from the indexes pip is configured with",
              file=sys.stderr)
    print("\n".join(args))


if __name__ == "__main__":
    main()
