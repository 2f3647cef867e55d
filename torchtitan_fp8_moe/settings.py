"""The `float8_moe` settings as either torchtitan version's converter receives them: a TOML
string where a list is meant (0.2.2 hands TOML values over unchecked; tyro only warns), or a
Python config entry's values (0.3)."""


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
