"""Report: ``report.html`` drawn from the files a run wrote, its figures, and the pseudo-image grids."""

from server_kit.report.grid import GRID_PADDING, write_grid
from server_kit.report.html import read_run, render_report, write_report

__all__ = ["GRID_PADDING", "read_run", "render_report", "write_grid", "write_report"]
