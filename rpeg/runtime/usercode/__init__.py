"""The user's code: ``python(...)`` functions, rewards, and tool calls in a sandbox.

``functions`` (a ``module:function`` imported as the spec found it), ``rewards`` (a reward
function called and its answers checked), ``sandbox`` (the client), ``sandbox_server``
(the process that forks one confined child per call), ``sandbox_probe`` (a tool that
answers at once).
"""
