"""What a 9 MB asset costs: message sizes, and the private verified copy of each process.

A factory model whose configuration module names a 9 MB ``tokenizer.json`` (Llama-3's is
about that size) is written to a temporary folder and loaded. The script prints:

* the bytes of one config message per channel: multiprocessing's ``ForkingPickler`` (a
  process on this machine: the digest travels, the receiver reads the store), plain
  ``pickle`` and cloudpickle (the code and the asset embedded, compressed, for another
  machine), one config and a list of three in one stream, with the config's JSON as the
  yardstick;
* the time of the first plain pickle (the unit's payload is compressed once per process)
  and of a later one;
* the cost of the private verified copy (``_loader.verified_dir``: write, read back and
  compare, make read-only) for the small unit of a plain factory model and for the unit
  with the 9 MB asset;
* a fresh spawned receiver's time from "config arrived" (``ForkingPickler``: read the store,
  verify, write its private copy, execute) to "asset bytes read through ``__file__``".

Run: ``python benchmarks/bench_assets.py [--size 9000000]`` (about a minute on 2 cores).
Caches live in a temporary folder, so the user's caches are never touched.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection


def _receiver(payload: bytes, conn: Connection) -> None:
    """A spawned process: unpickle the config, read the asset the way the model code does."""
    from multiprocessing.reduction import ForkingPickler

    from transformers import PretrainedConfig  # noqa: F401 - before the clock, as in any worker

    start = time.perf_counter()
    config = ForkingPickler.loads(payload)
    module = sys.modules[type(config).__module__]
    data = module.read_big_asset()
    took = time.perf_counter() - start
    conn.send((took, hashlib.sha256(data).hexdigest()))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--size", type=int, default=9_000_000, help="asset bytes")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="codeferry-bench-assets-")
    for var, sub in (("HF_HOME", "hf"), ("HF_MODULES_CACHE", "hf/modules"),
                     ("CODEFERRY_HOME", "codeferry")):
        os.environ[var] = os.path.join(tmp, sub)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from multiprocessing.reduction import ForkingPickler

        import cloudpickle
        from transformers import AutoConfig

        import codeferry
        from codeferry._runtime import loader as _loader
        from codeferry._runtime import pickling as _pickling
        from codeferry.testing import ModelSpec, write_model

        big = write_model(os.path.join(tmp, "big"), ModelSpec(name="bigtok", big_asset=args.size))
        small = write_model(os.path.join(tmp, "small"), ModelSpec(name="small"))
        start = time.perf_counter()
        codeferry.load(big, trust_remote_code=True)
        load_s = time.perf_counter() - start
        codeferry.load(small, trust_remote_code=True)
        config = AutoConfig.from_pretrained(big)
        as_json = len(config.to_json_string())

        start = time.perf_counter()
        plain = pickle.dumps(config)
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        pickle.dumps(config)
        later_s = time.perf_counter() - start
        forking = bytes(ForkingPickler.dumps(config))
        rows: list[tuple[str, int]] = [
            ("config JSON (yardstick)", as_json),
            ("ForkingPickler, 1 config", len(forking)),
            ("ForkingPickler, list of 3", len(bytes(ForkingPickler.dumps([config] * 3)))),
            ("pickle, 1 config", len(plain)),
            ("pickle, list of 3", len(pickle.dumps([config] * 3))),
            ("cloudpickle, 1 config", len(cloudpickle.dumps(config))),
            ("cloudpickle, list of 3", len(cloudpickle.dumps([config] * 3))),
        ]
        print(f"asset: tokenizer.json, {args.size:,} bytes; load() took {_ms(load_s)}")
        print(f"{'message':32} {'bytes':>12} {'x JSON':>8}")
        for label, size in rows:
            print(f"{label:32} {size:12,} {size / as_json:8.1f}")
        print(f"first plain pickle (compresses the payload once) {_ms(first_s)}; "
              f"later ones {_ms(later_s)}")

        for label, model in (("small unit", small), ("unit with the asset", big)):
            cfg = AutoConfig.from_pretrained(model)
            unit = _pickling.registration_of(type(cfg)).unit
            times = []
            for _ in range(3):
                old = _loader._private.pop(unit.token, None)  # a new copy, as a new process makes
                if old is not None:
                    _loader._remove_tree(old)
                start = time.perf_counter()
                _loader.verified_dir(unit)
                times.append(time.perf_counter() - start)
            total = sum(len(b) for b in unit.files.values())
            print(f"private verified copy, {label:20} ({total:>10,} bytes): {_ms(min(times))}")

        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(forking, child))
        proc.start()
        took, digest = parent.recv()
        proc.join(60)
        expected = hashlib.sha256((big / "tokenizer.json").read_bytes()).hexdigest()
        print(f"spawned receiver: config -> asset read through __file__ {_ms(took)} "
              f"({'verified bytes' if digest == expected else 'WRONG BYTES'})")
        return 0 if digest == expected else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
