"""The console scripts, one module per command: each parses its arguments, calls the library
and prints. `python -m orchard.cli.NAME` runs the command without installing it.

    orchard-train     orchard.cli.train      orchard-generate  orchard.cli.generate
    orchard-devices   orchard.cli.devices    orchard-prepare   orchard.cli.prepare
    orchard-bench     orchard.cli.bench      orchard-tune      orchard.cli.tune
    orchard-demo      orchard.cli.demo

orchard.cli.args holds what they share: the parser, typed and range-checked arguments, and
the rule that bad input ends in one line `orchard-X: error: ...` and exit status 2.
"""
