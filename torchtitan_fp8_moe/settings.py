"""The `float8_moe` settings as either torchtitan version's converter receives them: a TOML
string where a list is meant (0.2.2 hands TOML values over unchecked; tyro only warns), or a
Python config entry's values (0.3)."""

import dataclasses


def check_setting_types(settings) -> None:
    """Raise, naming the option, its value and the type it takes, where a bool or str setting
    of the dataclass ``settings`` (0.2.2's ``config.Float8MoE``, 0.3's converter ``Config``)
    holds a value of another type: neither version checks them (0.2.2's TOML values only make
    tyro warn; 0.3's config entries are Python), and ``emulate = "false"`` would be taken as
    true. ``fqns`` is read by ``fqn_entries``."""
    for f in dataclasses.fields(settings):
        if f.type not in (bool, str):
            continue
        value = getattr(settings, f.name)
        if isinstance(value, f.type):
            continue
        expected = (
            'a bool (true or false, unquoted: a string, even "false", reads as true)'
            if f.type is bool
            else "a str"
        )
        raise ValueError(
            f"float8_moe: {f.name} = {value!r} is of type {type(value).__name__}; {f.name} "
            f"takes {expected}"
        )


def fqn_entries(fqns) -> list[str]:
    """``fqns`` as its entries, each stripped of spaces: a list (or tuple) of strings, or one
    string, which is one entry or a comma-separated list of them, as torchtitan's command line
    reads list options (``--float8_moe.fqns=experts,shared_expert``)."""
    if isinstance(fqns, str):
        fqns = fqns.split(",")
    if not isinstance(fqns, list | tuple) or not all(isinstance(f, str) for f in fqns):
        raise ValueError(
            f"float8_moe: fqns = {fqns!r} is no list of module FQN substrings; set a list of "
            'strings or one comma-separated string, e.g. fqns = ["experts", "shared_expert"]'
        )
    return [f.strip() for f in fqns]
