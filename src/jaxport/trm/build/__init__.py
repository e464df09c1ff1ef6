"""Builders that write puzzle datasets in upstream TRM's on-disk format (see jaxport.trm.data).

`BUILDERS` maps each `jaxport trm build <name>` to (argparse parser factory, build function);
`parser(add_help=False)` can serve as a parent parser of a sub-command.
"""

from jaxport.trm.build import arc, maze, sudoku

BUILDERS = {
    "sudoku": (sudoku.parser, sudoku.build_sudoku),
    "maze": (maze.parser, maze.build_maze),
    "arc": (arc.parser, arc.build_arc),
}
