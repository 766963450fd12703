"""`InputError`: the base of every error that means "the input is wrong" (a config, checkpoint,
recipe, data file, routing payload or flag). The CLI prints such an error as one line,
`beam-rl <command>: error: <message>`, and exits 2; a traceback only with `--debug`. Messages name
the field or file and the fix."""


class InputError(ValueError):
    """Bad input; the message names what is wrong and how to fix it."""
