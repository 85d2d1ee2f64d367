"""The TaskGraph (tasks, buffers, accesses, JSON) and what every stage shares.

Plain data: no torch, no driver.
"""
