# The Debian package (cpack -G DEB in the build directory): the binaries (stripped), the
# systemd units, sysusers.d/tmpfiles.d snippets, man pages and completions, with the
# dependencies computed by dpkg-shlibdeps. lintian should report no errors on it.
set(CPACK_GENERATOR "DEB")
set(CPACK_PACKAGE_NAME "mep")
set(CPACK_PACKAGE_VENDOR "mep developers")
set(CPACK_PACKAGE_CONTACT "mep developers <dev@memoryendpoints.com>")
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "globally unique agent names and fenced leases on memory files")
set(CPACK_PACKAGE_DESCRIPTION
    "mep makes sure that two autonomous agents never run under the same name
(or a confusable one) and never write the same .uai memory file at the
same time, with leases and fencing tokens.

This package contains the mep command-line tool (claim, run, release,
branch, status, lineage, canonicalize, token, server, migrate), the mepd
host daemon with systemd units for per-user and system-wide use, and a
sandboxed unit for the mep server control plane.")
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
set(CPACK_STRIP_FILES ON)
# Directories in the package are 0755 whatever the umask of the build.
set(CPACK_INSTALL_DEFAULT_DIRECTORY_PERMISSIONS
    OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)

set(CPACK_DEBIAN_PACKAGE_NAME "mep")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_RELEASE 1)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "mep developers <dev@memoryendpoints.com>")
set(CPACK_DEBIAN_PACKAGE_SECTION "admin")
set(CPACK_DEBIAN_PACKAGE_PRIORITY "optional")
set(CPACK_DEBIAN_PACKAGE_HOMEPAGE "https://memoryendpoints.com")
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "graphviz")
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS OFF)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    "${CMAKE_CURRENT_LIST_DIR}/debian/postinst"
    "${CMAKE_CURRENT_LIST_DIR}/debian/prerm"
    "${CMAKE_CURRENT_LIST_DIR}/debian/postrm")

# Source packages are not made here.
set(CPACK_SOURCE_GENERATOR "")
include(CPack)
