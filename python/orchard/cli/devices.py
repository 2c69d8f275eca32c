"""orchard-devices: every device orchard can use, its measured facts, which one device=auto
picks and why, and how the training config is adapted to it.

    orchard-devices [--config YAML] [--json]
"""
import json
import sys

import orchard_ops

from ..config import load_config
from ..device_backend import GiB, auto_choice_reason, get_device_backend
from .args import Parser, console_script, path, reading

_FACTS = ("kind", "backend", "vendor", "platform", "driver_version", "compute_units",
          "global_mem_bytes", "local_mem_bytes", "max_work_group_size", "fp16", "fp64",
          "unified_memory")


EXAMPLES = (
    "orchard-devices",
    "orchard-devices --config configs/universal.yaml --json",
    "ORCHARD_DEVICE=opencl:0 orchard-devices",
)


@console_script("orchard-devices")
def main(argv=None):
    parser = Parser("orchard-devices", __doc__.split("\n\n")[0], EXAMPLES,
                    quiet=False)
    parser.add_argument("--config", type=path("a config file"), metavar="YAML",
                        help="A training config to adapt to the chosen device. Default: the "
                             "built-in universal config.")
    parser.add_argument("--json", action="store_true",
                        help="Print one JSON object (devices, auto choice, adapted config) "
                             "instead of text.")
    args = parser.parse_args(argv)

    listing = orchard_ops.devices()
    chosen, why = auto_choice_reason(listing)
    with reading("--config", args.config):     # a model no memory holds: its file named
        cfg, reasons = get_device_backend(chosen).adapt_config(load_config(args.config))
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
