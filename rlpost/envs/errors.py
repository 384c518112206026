"""The error an env or a transform raises on bad input."""


class EnvInputError(RuntimeError, ValueError):
    """Bad input to an env's reset or step (a missing key, no input at all).

    A RuntimeError, as TorchRL's envs raise, and a ValueError, as rlpost's other input checks
    raise: code catching either keeps working."""
