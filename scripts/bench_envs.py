"""Per-model environment figures: cold and warm creation with uv and with venv + pip, and
registration-to-ready of a model with requirements through a real mserve.

Usage: python scripts/bench_envs.py [--repeats 3]

The requirement set is three small local wheels installed offline from a wheelhouse, so the
figures measure the installers, not the network. Cold: a fresh cache folder; warm: the same key
again (a cache hit). Medians of the repeats.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from harness import Server, archive

from server.model_envs import EnvCache, EnvRequest
from tests.wheels import make_wheel

PACKAGES = [("benchpkg_a", "1.0"), ("benchpkg_b", "2.1"), ("benchpkg_c", "0.3")]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-envs-"))
    try:
        wheels = work / "wheels"
        for name, version in PACKAGES:
            make_wheel(wheels, name, version, f"VERSION = {version!r}\n" + "X = 1\n" * 2000)
        requirements = "\n".join(f"{n}=={v}" for n, v in PACKAGES)
        request = EnvRequest(requirements, "bench:1", wheels)
        print(
            f"requirement set: {len(PACKAGES)} local wheels, offline; {args.repeats} runs, medians"
        )
        for installer in ("uv", "pip"):
            cold, warm = [], []
            for i in range(args.repeats):
                cache = EnvCache(work / f"cache-{installer}-{i}", use_uv=installer == "uv")
                cold.append(timed(lambda c=cache: c.ensure(request)))
                warm.append(timed(lambda c=cache: c.ensure(request)))
            label = "uv venv + uv pip" if installer == "uv" else "python -m venv + pip"
            print(f"{label:<22} cold {statistics.median(cold):6.2f} s   warm "
                  f"{statistics.median(warm) * 1000:6.1f} ms")  # fmt: skip

        # registration to ready through mserve, with a cold and then a warm cache
        (work / "h.py").write_text(
            "import benchpkg_a\n\ndef handle(data, context):\n"
            "    return [benchpkg_a.VERSION for _ in data or []]\n"
        )
        (work / "requirements.txt").write_text(requirements + "\n")
        for name in ("m1", "m2"):
            archive(work / "store", name, "--handler", work / "h.py", "-r",
                    work / "requirements.txt", "--wheelhouse", wheels)  # fmt: skip
        # loopback only; it registers models and measures environments
        server = Server(work, {"grpc": False, "disable_token_authorization": True,
                               "enable_model_api": True})  # fmt: skip
        try:
            for name, what in (("m1", "cold cache"), ("m2", "warm cache")):
                started = time.perf_counter()
                status, body = server.request("POST", f"/models?url={name}.mar", api="management")
                took = time.perf_counter() - started
                if status != 200:
                    raise SystemExit(f"registering {name}: {status} {body[:300]!r}")
                print(f"registration to ready, model with requirements, {what}: {took:.2f} s")
        finally:
            server.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
