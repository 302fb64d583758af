"""Key checks in isolation (the network cases are in test_auth.py)."""

import pytest

from router.auth import Auth
from router.config import AuthConfig
from router.errors import GatewayError


def hdr(token=None):
    return [(b"authorization", b"Bearer " + token.encode())] if token else []


def status(fn, *args):
    try:
        fn(*args)
    except GatewayError as e:
        return e.status
    return 200


@pytest.mark.parametrize("host, expected", [("127.0.0.1", 200), ("::1", 200), ("10.1.2.3", 403),
                                            ("192.168.0.9", 403), (None, 403), ("not-an-ip", 403)])
def test_admin_without_admin_key_is_for_loopback_clients_only(host, expected):
    auth = Auth(AuthConfig())
    assert status(auth.check_admin, hdr(), host) == expected


def test_admin_key_works_from_anywhere_and_client_keys_are_forbidden():
    auth = Auth(AuthConfig(api_keys=["c"], admin_key="a"))
    assert status(auth.check_admin, hdr("a"), "10.1.2.3") == 200
    assert status(auth.check_admin, hdr("c"), "127.0.0.1") == 403
    assert status(auth.check_admin, hdr(), "127.0.0.1") == 401
    assert status(auth.check_admin, hdr("x"), "127.0.0.1") == 401


def test_client_keys():
    auth = Auth(AuthConfig(api_keys=["k1", "k2"]))
    assert status(auth.check_client, hdr("k2")) == 200
    assert status(auth.check_client, hdr("k3")) == 401
    assert status(auth.check_client, [(b"authorization", b"Basic azE=")]) == 401
    assert status(Auth(AuthConfig()).check_client, hdr()) == 200
