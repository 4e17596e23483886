"""PostgreSQL advisory lock keys, all in one place so no two locks ever share a key.

The lockout's key once equalled the cycle's, so a failed sign-in waited for a scheduling
cycle; portal/tests/test_locks.py keeps them distinct.
"""

AUDIT_CHAIN = 7_310_001  # appending to the audit hash chain (portal.audit.lock_chain)
SCHEDULING_CYCLE = 7_310_002  # one scheduling cycle at a time (scheduling.cycle.cycle_lock)
LOGIN_LOCKOUT = 7_310_003  # one lockout audit event per (user name, address) (portal.lockout)

ALL = {"AUDIT_CHAIN": AUDIT_CHAIN, "SCHEDULING_CYCLE": SCHEDULING_CYCLE, "LOGIN_LOCKOUT": LOGIN_LOCKOUT}
