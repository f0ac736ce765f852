"""dtbench command line (``dtbench.cli``): the click commands on top of the harness and the reports."""
