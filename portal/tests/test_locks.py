"""Advisory lock keys never collide, and the modules use the keys portal.locks names."""

from portal import audit, lockout, locks
from scheduling import cycle


def test_every_advisory_lock_has_its_own_key():
    assert len(set(locks.ALL.values())) == len(locks.ALL)


def test_the_modules_take_the_keys_they_are_given():
    assert audit._CHAIN_LOCK == locks.AUDIT_CHAIN
    assert cycle.CYCLE_LOCK_KEY == locks.SCHEDULING_CYCLE
    assert lockout._LOCKOUT_AUDIT_LOCK == locks.LOGIN_LOCKOUT
