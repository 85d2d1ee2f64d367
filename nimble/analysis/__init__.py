"""Analysis of a TaskGraph: dependencies, stream assignment, memory plan, plan check, arena
fit, priorities, backfill and reports.

numpy only: no torch, no driver, so it runs (and is tested) on any machine.
"""
