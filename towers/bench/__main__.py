"""``python -m towers.bench``: the same as ``python -m towers bench``."""

import argparse
import sys

from towers.cli import bench as cli

parser = argparse.ArgumentParser(
    prog="python -m towers.bench",
    description=cli.__doc__,
    epilog=cli.EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)
cli.add_arguments(parser)
sys.exit(cli.run(parser.parse_args()))
