"""A tool that answers at once: what a sandboxed call costs by itself (``rpeg calibrate
--tools`` measures it into the profile's ``tool_call_s``)."""


def echo(text: str) -> str:
    return text
