"""dtbench reports (``dtbench.reports``): tables, comparisons, exports and figures read from the results database."""
