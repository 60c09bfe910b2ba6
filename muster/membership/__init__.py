"""Dial-in membership (seed 003): the join window's state machine and the admission rules.
Pure: no I/O; the controller applies what these decide."""
