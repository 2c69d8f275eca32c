"""The float64 reference now lives in the package (orchard.reference); this re-export keeps
`from reference import ...` of the orchard_ops tests working."""
from orchard.reference import *  # noqa: F401,F403
