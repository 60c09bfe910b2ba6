"""Join window state machine and admission decisions (seed 003). Pure.

Arrives with the join-window issue.
"""
