"""The plan lowered to what runs: one op call per (op, step, chunk or rank), on one device.

``calls`` (one op call, a frozen value), ``instances`` (the calls laid out), ``ordering``
(the pure passes adding their weight transfers and ordering edges),
``replicas`` (which copy of a model a call reads; a sync's roles), ``joins`` (one call
through which a large gang's ranks wait), ``context`` (what every worker is told at
set-up). Each call is one device's share of an instance of the plan's placed graph
(``rpeg.plan.lower.Placed``, ``OpCall.instance``).
"""
