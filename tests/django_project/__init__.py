"""A minimal Django project for tests/integration/test_django.py: one app (`shop`, its `Order`
model) on PostgreSQL. The database is the test's (test_django.py points `default` at it)."""
