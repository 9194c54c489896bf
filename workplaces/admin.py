"""Admin for workplaces."""

from django.contrib import admin
from simple_history.admin import SimpleHistoryAdmin

from workplaces.models import Workplace


@admin.register(Workplace)
class WorkplaceAdmin(SimpleHistoryAdmin):
    list_display = ["name", "organisation", "image", "updated_at"]
    list_filter = ["organisation"]
    list_select_related = ["organisation"]
    search_fields = ["name", "image", "organisation__name"]
    autocomplete_fields = ["organisation"]
