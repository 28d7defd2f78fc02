// k8s-validate: strict decoding of Kubernetes manifests into the typed API objects of
// k8s.io/api, the offline stand-in for kubeconform (whose JSON schemas are downloaded at
// run time). Reads multi-document YAML from the files named (or stdin) and fails on:
//
//   - a kind/apiVersion that k8s.io/api does not know (typo, removed beta API);
//   - an unknown or duplicated field, or a value of the wrong type (strict decoding);
//   - a missing or non-DNS-1123 metadata.name;
//   - a Deployment, StatefulSet or DaemonSet whose selector does not match its pod labels,
//     or a container without an image.
//
// Usage: helm template ... | k8s-validate -        (or: k8s-validate a.yaml b.yaml)
// Prints one "ok Kind/name" line per object; exits 1 on the first file with errors.
package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	nodev1 "k8s.io/api/node/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

func newScheme() *runtime.Scheme {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, rbacv1.AddToScheme, policyv1.AddToScheme,
		networkingv1.AddToScheme, batchv1.AddToScheme, nodev1.AddToScheme, schedulingv1.AddToScheme,
		autoscalingv2.AddToScheme, storagev1.AddToScheme,
	} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	return s
}

// splitDocs splits a YAML stream on "---" lines, dropping empty and comment-only documents.
func splitDocs(data []byte) [][]byte {
	var docs [][]byte
	for _, part := range strings.Split("\n"+string(data), "\n---") {
		keep := false
		for _, line := range strings.Split(part, "\n") {
			t := strings.TrimSpace(line)
			if t != "" && !strings.HasPrefix(t, "#") {
				keep = true
				break
			}
		}
		if keep {
			docs = append(docs, []byte(part))
		}
	}
	return docs
}

func checkPodTemplate(kind string, selector *metav1.LabelSelector, tpl corev1.PodTemplateSpec) []string {
	var errs []string
	sel, err := metav1.LabelSelectorAsSelector(selector)
	if err != nil || sel.Empty() {
		errs = append(errs, fmt.Sprintf("%s: spec.selector is missing or invalid (%v)", kind, err))
	} else if !sel.Matches(labels.Set(tpl.Labels)) {
		errs = append(errs, fmt.Sprintf("%s: spec.selector %s does not match the pod template labels %v",
			kind, sel, tpl.Labels))
	}
	all := append(append([]corev1.Container{}, tpl.Spec.InitContainers...), tpl.Spec.Containers...)
	if len(tpl.Spec.Containers) == 0 {
		errs = append(errs, kind+": no containers")
	}
	for _, c := range all {
		if c.Image == "" {
			errs = append(errs, fmt.Sprintf("%s: container %q has no image", kind, c.Name))
		}
	}
	return errs
}

func validate(obj runtime.Object) []string {
	var errs []string
	if m, ok := obj.(metav1.Object); ok {
		for _, msg := range validation.IsDNS1123Subdomain(m.GetName()) {
			errs = append(errs, "metadata.name "+fmt.Sprintf("%q", m.GetName())+": "+msg)
		}
	}
	switch o := obj.(type) {
	case *appsv1.Deployment:
		errs = append(errs, checkPodTemplate("Deployment", o.Spec.Selector, o.Spec.Template)...)
	case *appsv1.StatefulSet:
		errs = append(errs, checkPodTemplate("StatefulSet", o.Spec.Selector, o.Spec.Template)...)
	case *appsv1.DaemonSet:
		errs = append(errs, checkPodTemplate("DaemonSet", o.Spec.Selector, o.Spec.Template)...)
	}
	return errs
}

func main() {
	args := os.Args[1:]
	if len(args) == 0 {
		args = []string{"-"}
	}
	decoder := serializer.NewCodecFactory(newScheme(), serializer.EnableStrict).UniversalDeserializer()
	failed := false
	for _, name := range args {
		var data []byte
		var err error
		if name == "-" {
			data, err = io.ReadAll(os.Stdin)
		} else {
			data, err = os.ReadFile(name)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "k8s-validate: %v\n", err)
			os.Exit(2)
		}
		for i, doc := range splitDocs(data) {
			var head struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			_ = yaml.Unmarshal(bytes.TrimSpace(doc), &head)
			where := fmt.Sprintf("%s[%d] %s/%s", name, i, head.Kind, head.Metadata.Name)
			obj, _, err := decoder.Decode(doc, nil, nil)
			if err != nil {
				fmt.Fprintf(os.Stderr, "FAIL %s: %v\n", where, err)
				failed = true
				continue
			}
			if errs := validate(obj); len(errs) > 0 {
				for _, e := range errs {
					fmt.Fprintf(os.Stderr, "FAIL %s: %s\n", where, e)
				}
				failed = true
				continue
			}
			fmt.Printf("ok %s/%s\n", head.Kind, head.Metadata.Name)
		}
	}
	if failed {
		os.Exit(1)
	}
}
