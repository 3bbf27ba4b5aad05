"""ns per atomic operation of cxlrpc._atomic, beside another module with the same interface
(atomicshm, which cxlrpc used before) where it is installed: load, store, cas and fetch_add,
as bound methods of the view (AtomicMemory's form) and of a cell (Counter's form).

    python bench/atomic_ops.py [--rounds 7] [--n 1000000]

Rounds alternate the modules; the table gives each one's best and median round.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import timeit
from types import ModuleType

FORMS = {
    "view.load_u64": ("f = v.load_u64", "f(8, ACQ)"),
    "view.store_u64": ("f = v.store_u64", "f(8, 5, REL)"),
    "view.cas_u64": ("f = v.cas_u64", "f(8, 0, 0, AR)"),
    "view.fetch_add_u64": ("f = v.fetch_add_u64", "f(8, 1, AR)"),
    "cell.load": ("f = v.cell_u64(8).load", "f(ACQ)"),
    "cell.store": ("f = v.cell_u64(8).store", "f(5, REL)"),
    "cell.cas": ("f = v.cell_u64(8).cas", "f(0, 0, AR)"),
    "cell.fetch_add": ("f = v.cell_u64(8).fetch_add", "f(1, AR)"),
}


def per_op_ns(mod: ModuleType, form: str, n: int) -> float:
    """One round: ns per call of ``form`` over a 4 KiB bytearray, the loop's own cost removed."""
    bind, stmt = FORMS[form]
    env = {"v": mod.AtomicView(bytearray(4096)), "ACQ": mod.ACQUIRE, "REL": mod.RELEASE, "AR": mod.ACQ_REL}
    exec(bind, env)
    empty = timeit.timeit("pass", number=n)
    return (timeit.timeit(stmt, globals=env, number=n) - empty) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--other", default="atomicshm", help="a module with atomicshm's interface")
    args = ap.parse_args()
    mods = {"cxlrpc._atomic": importlib.import_module("cxlrpc._atomic")}
    try:
        mods[args.other] = importlib.import_module(args.other)
    except ImportError:
        print(f"({args.other} is not installed: cxlrpc._atomic alone)")
    times: dict[tuple[str, str], list[float]] = {(m, f): [] for m in mods for f in FORMS}
    for _ in range(args.rounds):
        for form in FORMS:
            for name, mod in mods.items():
                times[name, form].append(per_op_ns(mod, form, args.n))
    print(f"{'form':<22}" + "".join(f"{name + ' best/median ns':>34}" for name in mods))
    for form in FORMS:
        cells = (f"{min(times[m, form]):.1f} / {statistics.median(times[m, form]):.1f}" for m in mods)
        print(f"{form:<22}" + "".join(f"{c:>34}" for c in cells))


if __name__ == "__main__":
    main()
