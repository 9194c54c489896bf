"""Pagination for every list endpoint: ordered querysets, bounded pages."""

from rest_framework.pagination import PageNumberPagination


class BoundedPagination(PageNumberPagination):
    """Page-number pagination whose page size a client may lower or raise, up to a cap."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
