"""Budgets, prices and the ledger of what model requests cost.

Change them only through ``budgets.services`` (budgets) and ``budgets.metering`` (the ledger,
which reserves and settles in single conditional updates, so concurrent requests never together
spend more than a budget holds).
"""

from decimal import Decimal

from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q

from budgets import periods
from budgets.money import dollars
from budgets.usage import Prices
from organisations.models import TenantQuerySet

# Dollars, to a millionth: amounts max_digits=14, prices per million tokens max_digits=12.
DEFAULT_THRESHOLDS = [50, 80, 100]


def default_thresholds() -> list[int]:
    return list(DEFAULT_THRESHOLDS)


class Period(models.TextChoices):
    NONE = periods.NONE, "no period (one amount, for ever)"
    DAILY = periods.DAILY, "daily"
    WEEKLY = periods.WEEKLY, "weekly (from Monday)"
    MONTHLY = periods.MONTHLY, "monthly (from the first)"


class Vendor(models.TextChoices):
    ANTHROPIC = "anthropic", "Anthropic (Messages API)"
    OPENAI = "openai", "OpenAI (Chat Completions and Responses APIs)"


class Price(models.Model):
    """What a vendor's model costs, in US dollars per million tokens of each kind, from a moment
    on (dated data: a change is a new row, and applies to requests that start after it)."""

    vendor = models.CharField(
        max_length=16,
        choices=Vendor.choices,
        default=Vendor.ANTHROPIC,
        help_text="Whose API the model is called by: a price applies to that API's requests.",
    )
    model = models.CharField(
        max_length=100,
        db_index=True,
        validators=[
            RegexValidator(
                r"^[A-Za-z0-9._:@-]+\*?$",
                "A model id (letters, digits, . _ : @ -), or a pattern with one * at its end.",
            )
        ],
        help_text="A model id, or a pattern ending in *: claude-sonnet-4-5-* prices"
        " claude-sonnet-4-5-20250929 (a row naming the model wins, then the longest pattern)."
        " OpenAI's cached input is priced as a cache read (it has no cache writes).",
    )
    input = models.DecimalField(
        max_digits=12,
        decimal_places=6,
        validators=[MinValueValidator(0)],
        help_text="US dollars per million tokens (as every price here).",
    )
    cache_write_5m = models.DecimalField(
        max_digits=12,
        decimal_places=6,
        validators=[MinValueValidator(0)],
        verbose_name="cache write (5 min)",
    )
    cache_write_1h = models.DecimalField(
        max_digits=12,
        decimal_places=6,
        validators=[MinValueValidator(0)],
        verbose_name="cache write (1 h)",
    )
    cache_read = models.DecimalField(
        max_digits=12, decimal_places=6, validators=[MinValueValidator(0)]
    )
    output = models.DecimalField(max_digits=12, decimal_places=6, validators=[MinValueValidator(0)])
    effective_from = models.DateTimeField()
    effective_until = models.DateTimeField(null=True, blank=True)
    source = models.CharField(max_length=300, help_text="Where the prices come from.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["vendor", "model", "-effective_from"]
        constraints = [
            models.CheckConstraint(
                condition=Q(effective_until__isnull=True)
                | Q(effective_until__gt=F("effective_from")),
                name="price_until_after_from",
            ),
            # One price per model from one moment: which of two would apply is not guessed.
            models.UniqueConstraint(
                fields=["vendor", "model", "effective_from"], name="price_one_per_start"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model} from {self.effective_from:%Y-%m-%d}"

    @property
    def prices(self) -> Prices:
        return Prices(
            input=self.input,
            cache_write_5m=self.cache_write_5m,
            cache_write_1h=self.cache_write_1h,
            cache_read=self.cache_read,
            output=self.output,
        )


class Budget(models.Model):
    """What an agent (or, without one, an organisation, capping the sum of its agents) may
    spend on models in each period."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.CASCADE, related_name="budgets"
    )
    agent = models.OneToOneField(
        "agents.Agent", on_delete=models.CASCADE, null=True, blank=True, related_name="budget"
    )
    amount = models.DecimalField(
        max_digits=14,
        decimal_places=6,
        validators=[MinValueValidator(Decimal(0))],
        help_text="US dollars per period.",
    )
    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTHLY)
    thresholds = models.JSONField(
        default=default_thresholds,
        blank=True,
        help_text="Percentages of the amount at which the organisation's admins (by email) and"
        " its webhook (budget.threshold) are told, once per period.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["organisation_id", "pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["organisation"],
                condition=Q(agent__isnull=True),
                name="budget_one_per_organisation",
            )
        ]

    def __str__(self) -> str:
        return f"budget of {self.agent or self.organisation}"


class Spend(models.Model):
    """One budget's one period: its limit then, what was spent, and what open requests hold."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="spends")
    period = models.CharField(max_length=8, choices=Period.choices)
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    limit = models.DecimalField(max_digits=14, decimal_places=6)
    spent = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal(0))
    reserved = models.DecimalField(max_digits=14, decimal_places=6, default=Decimal(0))
    alerted = models.JSONField(default=list, blank=True, help_text="Thresholds told of.")
    exhausted_at = models.DateTimeField(
        null=True,
        blank=True,
        verbose_name="used up at",
        help_text="When a request found that what was spent leaves less than any request can"
        " cost (what requests under way hold does not count): the budget is used up until it"
        " is raised or its period ends.",
    )

    class Meta:
        ordering = ["budget_id", "-starts_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["budget", "period", "starts_at"], name="spend_one_per_period"
            ),
            models.CheckConstraint(
                condition=Q(reserved__gte=0), name="spend_reserved_not_negative"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.budget} from {self.starts_at:%Y-%m-%d}"

    @property
    def remaining(self) -> Decimal:
        return self.limit - self.spent - self.reserved


class Reservation(models.Model):
    """The worst case of one model request, held against its budgets until it is settled (a
    charge) or released."""

    class Status(models.TextChoices):
        OPEN = "open"
        SETTLED = "settled"
        RELEASED = "released"

    request_id = models.CharField(max_length=64, unique=True)
    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="+"
    )
    agent = models.ForeignKey("agents.Agent", on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey(
        "runs.Run", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    model = models.CharField(max_length=100)
    price = models.ForeignKey(Price, on_delete=models.PROTECT, related_name="+")
    amount = models.DecimalField(max_digits=14, decimal_places=6)
    spends = models.ManyToManyField(Spend, related_name="+", blank=True)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.OPEN)
    created_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.request_id} ({self.status})"


class Outcome(models.TextChoices):
    COMPLETE = "complete"
    ERROR = "error", "ended with an error"
    CUT_OFF = "cut-off", "cut off"
    UNSETTLED = "unsettled", "never settled: charged its worst case"


class Charge(models.Model):
    """One model request's cost: a row of the ledger, never changed or deleted."""

    request_id = models.CharField(max_length=64, unique=True)
    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.PROTECT, related_name="+"
    )
    agent = models.ForeignKey("agents.Agent", on_delete=models.PROTECT, related_name="charges")
    run = models.ForeignKey(
        "runs.Run", on_delete=models.SET_NULL, null=True, blank=True, related_name="charges"
    )
    model = models.CharField(max_length=100, help_text="The model that answered.")
    input_tokens = models.PositiveBigIntegerField(default=0)
    cache_write_5m_tokens = models.PositiveBigIntegerField(default=0)
    cache_write_1h_tokens = models.PositiveBigIntegerField(default=0)
    cache_read_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    cost = models.DecimalField(max_digits=14, decimal_places=6)
    price = models.ForeignKey(Price, on_delete=models.PROTECT, related_name="charges")
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.COMPLETE)
    started_at = models.DateTimeField(help_text="When the request began: its period's.")
    at = models.DateTimeField(auto_now_add=True, db_index=True, help_text="When it was settled.")

    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["agent", "at"])]

    def __str__(self) -> str:
        return f"{self.request_id}: {dollars(self.cost, exact=True)}"


class ModelKey(models.Model):
    """An organisation's API key at a model vendor, which the model gateway sends for its
    agents (they never hold it). Kept encrypted (covey/crypto.py); shown never again after it
    is entered: people see its last characters, to recognise it."""

    organisation = models.ForeignKey(
        "organisations.Organisation", on_delete=models.CASCADE, related_name="model_keys"
    )
    vendor = models.CharField(max_length=16, choices=Vendor.choices, default=Vendor.ANTHROPIC)
    secret = models.TextField(editable=False)  # encrypted
    hint = models.CharField(max_length=16, editable=False, help_text="Its last characters.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TenantQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organisation", "vendor"], name="one_key_per_vendor")
        ]

    def __str__(self) -> str:
        return f"{self.get_vendor_display()} key …{self.hint}"


class GatewayTokenQuerySet(TenantQuerySet):
    membership_lookup = "agent__organisation__memberships__user"


class GatewayToken(models.Model):
    """A run's credential at the model gateway: only its SHA-256 is kept; revoked when the run
    ends."""

    agent = models.ForeignKey("agents.Agent", on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(
        "runs.Run", on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    sha256 = models.CharField(max_length=64, unique=True, editable=False)
    prefix = models.CharField(max_length=12, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = GatewayTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… for {self.agent}"
