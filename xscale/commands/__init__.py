"""One module per ``xscale`` command (``xscale/cli.py`` only dispatches): each parses its arguments, loads what it
needs and reports in plain lines. Commands sit above every other layer; importing one registers the checks and
adapters of the layers it uses."""
