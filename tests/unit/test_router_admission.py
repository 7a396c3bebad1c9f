"""Tenants, tiers, API keys and shedding at the router's door."""

import pytest
from pydantic import ValidationError

from phalanx.common.errors import AuthenticationError, InvalidRequestError, RequestShedError, ResourceExhaustedError
from phalanx.router.admission import Admission, Tier
from phalanx.router.config import RouterConfig, TenantPolicy

pytestmark = pytest.mark.unit

TENANTS = {
    "default": TenantPolicy(),
    "batch": TenantPolicy(default_tier="best_effort", max_tier="standard"),
}


def test_unnamed_tenant_and_tier_default_to_the_default_tenant_at_its_default_tier():
    admitted = Admission(TENANTS, {}).admit(tenant="", tier=0, api_key=None)
    assert (admitted.tenant, admitted.tier) == ("default", Tier.STANDARD)


def test_unknown_tenant_and_unknown_tier_are_invalid_arguments():
    admission = Admission(TENANTS, {})
    with pytest.raises(InvalidRequestError) as error:
        admission.admit(tenant="nobody", tier=0, api_key=None)
    assert error.value.violations[0].field == "tenant"
    with pytest.raises(InvalidRequestError) as error:
        admission.admit(tenant="", tier=7, api_key=None)
    assert error.value.violations[0].field == "tier"


def test_tenant_may_not_ask_above_its_max_tier():
    admission = Admission(TENANTS, {})
    assert admission.admit(tenant="batch", tier=0, api_key=None).tier == Tier.BEST_EFFORT
    assert admission.admit(tenant="batch", tier=Tier.STANDARD, api_key=None).tier == Tier.STANDARD
    with pytest.raises(InvalidRequestError, match="standard at most"):
        admission.admit(tenant="batch", tier=Tier.PREMIUM, api_key=None)


def test_api_keys_decide_the_tenant_and_are_required_when_configured():
    admission = Admission(TENANTS, {"k-batch": "batch"})
    assert admission.admit(tenant="", tier=0, api_key="k-batch").tenant == "batch"
    with pytest.raises(AuthenticationError):
        admission.admit(tenant="", tier=0, api_key=None)
    with pytest.raises(AuthenticationError):
        admission.admit(tenant="", tier=0, api_key="wrong")
    with pytest.raises(InvalidRequestError, match="belongs to tenant"):
        admission.admit(tenant="default", tier=0, api_key="k-batch")


@pytest.mark.parametrize(
    ("level", "shed"),
    [(0, set()), (1, set()), (2, {Tier.BEST_EFFORT}), (3, {Tier.BEST_EFFORT}), (4, set(Tier))],
)
def test_degradation_level_sheds_tiers_with_a_retry_hint(level, shed):
    admission = Admission(TENANTS, {}, retry_after_s=0.5)
    admission.level = level
    for tier in Tier:
        if tier in shed:
            with pytest.raises(RequestShedError, match=f"level {level}.*{tier.label}") as error:
                admission.admit(tenant="", tier=tier, api_key=None)
            assert error.value.retry_after_s >= 0.5
        else:
            assert admission.admit(tenant="", tier=tier, api_key=None).tier == tier


def _first_shed(admission: Admission) -> dict[Tier, int]:
    first_shed = {}
    for level in range(6):  # 5: a level beyond the known ones sheds no more than 4
        admission.level = level
        for tier in Tier:
            try:
                admission.admit(tenant="", tier=tier, api_key=None)
            except RequestShedError:
                first_shed.setdefault(tier, level)
    return first_shed


def test_shedding_hits_best_effort_at_two_and_every_tier_at_four():
    assert _first_shed(Admission(TENANTS, {})) == {Tier.BEST_EFFORT: 2, Tier.STANDARD: 4, Tier.PREMIUM: 4}


def test_premium_at_level_four_is_an_explicit_option():
    assert _first_shed(Admission(TENANTS, {}, premium_at_level_4=True)) == {Tier.BEST_EFFORT: 2, Tier.STANDARD: 4}


def test_shed_request_is_resource_exhausted_and_waits_longer_at_level_four():
    admission = Admission(TENANTS, {}, retry_after_s=1.5)
    admission.level = 2
    with pytest.raises(RequestShedError) as at_two:
        admission.admit(tenant="", tier=Tier.BEST_EFFORT, api_key=None)
    admission.level = 4
    with pytest.raises(RequestShedError) as at_four:
        admission.admit(tenant="", tier=Tier.STANDARD, api_key=None)
    assert isinstance(at_two.value, ResourceExhaustedError) and at_two.value.reason == "REQUEST_SHED"
    assert at_two.value.retry_after_s == 1.5
    assert at_four.value.retry_after_s == 3.0
    assert str(at_two.value) == "overloaded (degradation level 2): best_effort requests are shed; retry in 1.5 s"
    assert str(at_four.value) == (
        "overloaded (degradation level 4): every new request is refused, standard included, while the requests in flight finish; "
        "retry in 3 s"
    )


def test_level_four_refuses_a_premium_tenant_unless_premium_is_served_there():
    tenants = {"default": TenantPolicy(), "gold": TenantPolicy(default_tier="premium", max_tier="premium")}
    admission = Admission(tenants, {})
    admission.level = 4
    with pytest.raises(RequestShedError, match="every new request is refused, premium included"):
        admission.admit(tenant="gold", tier=0, api_key=None)
    serving = Admission(tenants, {}, premium_at_level_4=True)
    serving.level = 4
    assert serving.admit(tenant="gold", tier=0, api_key=None).tier == Tier.PREMIUM
    with pytest.raises(RequestShedError, match="standard requests are shed, only premium is served"):
        serving.admit(tenant="default", tier=0, api_key=None)


def test_the_tenant_of_a_running_request_resolves_at_any_level():
    # Resume and retries of running requests check the caller's key, never the level: draining loses nothing.
    admission = Admission(TENANTS, {"k-batch": "batch"})
    admission.level = 4
    assert admission.tenant("", "k-batch") == "batch"
    with pytest.raises(AuthenticationError):
        admission.tenant("", "wrong")


def test_router_config_reads_tenants_and_keys_from_env(monkeypatch):
    monkeypatch.setenv("PHALANX_ROUTER_TENANTS", '{"default": {}, "batch": {"default_tier": "best_effort", "max_tier": "standard"}}')
    monkeypatch.setenv("PHALANX_ROUTER_API_KEYS", '{"secret": "batch"}')
    config = RouterConfig()
    assert config.tenants["batch"].max_tier == "standard"
    assert config.api_keys == {"secret": "batch"}


def test_premium_at_level_four_is_off_unless_the_environment_turns_it_on(monkeypatch):
    assert RouterConfig().premium_at_level_4 is False
    monkeypatch.setenv("PHALANX_ROUTER_PREMIUM_AT_LEVEL_4", "true")
    assert RouterConfig().premium_at_level_4 is True


def test_router_config_refuses_keys_of_unknown_tenants_and_half_tls():
    with pytest.raises(ValidationError, match="unknown tenants"):
        RouterConfig(api_keys={"k": "ghost"})
    with pytest.raises(ValidationError, match="go together"):
        RouterConfig(tls_cert_file="cert.pem")
    with pytest.raises(ValidationError, match="above max_tier"):
        RouterConfig(tenants={"default": TenantPolicy(default_tier="premium", max_tier="standard")})
