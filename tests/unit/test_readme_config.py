"""The README's configuration table lists every flag of every service, with its real default."""
from services import REPO_ROOT
from services.common.config_table import block


def test_readme_configuration_table_is_complete_and_current():
    readme = (REPO_ROOT / "README.md").read_text()
    assert block() in readme, "regenerate it: python -m services.common.config_table --write README.md"
