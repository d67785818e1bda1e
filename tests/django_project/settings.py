"""Django settings of the test project. `DATABASES["default"]` is pointed at each test's own
database (cloned from delaysvc's migrated template) by tests/integration/test_django.py."""

SECRET_KEY = "delaysvc-tests"
INSTALLED_APPS = ["tests.django_project.shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "postgres"}}
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
