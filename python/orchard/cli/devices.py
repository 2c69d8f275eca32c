"""orchard-devices: every device orchard can use, its measured facts, which one device=auto
picks and why, and how the training config is adapted to it.

    orchard-devices [--config YAML] [--json]
"""
import argparse
import json
import sys

import orchard_ops

from ..config import ConfigError, load_config
from ..device_backend import GiB, auto_choice_reason, get_device_backend

_FACTS = ("kind", "backend", "vendor", "platform", "driver_version", "compute_units",
          "global_mem_bytes", "local_mem_bytes", "max_work_group_size", "fp16", "fp64",
          "unified_memory")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="orchard-devices", description=__doc__.split("\n")[0])
    parser.add_argument("--config", metavar="YAML",
                        help="config to adapt to the chosen device (default: the universal one)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    listing = orchard_ops.devices()
    chosen, why = auto_choice_reason(listing)
    backend = get_device_backend(chosen)
    try:
        cfg, reasons = backend.adapt_config(load_config(args.config))
    except ConfigError as exc:
        print("orchard-devices: error: %s" % exc, file=sys.stderr)
        return 2
    if args.json:
        json.dump({"devices": listing, "auto": chosen, "why": why, "config": cfg,
                   "reasons": reasons}, sys.stdout, indent=2)
        print()
        return 0
    for d in listing:
        mark = "*" if d["id"] == chosen else " "
        print("%s %-10s %s" % (mark, d["id"], d["name"]))
        for key in _FACTS + tuple(sorted(set(d) - set(_FACTS) - {"id", "name"})):
            value = d.get(key)
            if key.endswith("_bytes") and isinstance(value, int):
                value = "%d (%.2f GiB)" % (value, value / GiB) if value >= GiB else value
            print("      %-20s %s" % (key, value))
    print("\nauto picks %s: %s" % (chosen, why))
    print("\nthe config adapted to %s:" % chosen)
    for key, reason in reasons.items():
        print("  %s: %s" % (key, reason))
    return 0


if __name__ == "__main__":
    sys.exit(main())
